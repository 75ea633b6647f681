"""Replicas on one machine's cores share its BLAS threads (backend/cpu_threads.share_blas),
as data-parallel training on virtual CPU devices asks."""
import gc
import os

import pytest
import threadpoolctl

from caffe_syncbn.backend import cpu_threads


def blas_threads():
    return [info['num_threads'] for info in threadpoolctl.threadpool_info()
            if info['user_api'] == 'blas']


@pytest.mark.parametrize('cores, replicas, share', [(8, 3, 2), (8, 4, 2), (2, 4, 1), (16, 2, 8)])
def test_each_replica_gets_its_share_of_the_cores(monkeypatch, cores, replicas, share):
    asked = []
    monkeypatch.setattr(os, 'cpu_count', lambda: cores)
    monkeypatch.setattr(threadpoolctl, 'threadpool_limits',
                        lambda limits, user_api: asked.append((limits, user_api)) or 'limit')
    assert cpu_threads.share_blas(replicas) == 'limit'
    assert asked == [(share, 'blas')]


def test_one_replica_keeps_the_blas_as_it_is(monkeypatch):
    monkeypatch.setattr(threadpoolctl, 'threadpool_limits', lambda **kwargs: pytest.fail(kwargs))
    assert cpu_threads.share_blas(1) is None


def test_the_limit_holds_until_it_is_lifted(monkeypatch):
    """(The solvers of earlier tests lift their own limits when they are collected: they
    are collected first, and no collection runs meanwhile.)"""
    if not blas_threads():
        pytest.skip('numpy has no BLAS that threadpoolctl controls')
    gc.collect()
    gc.disable()
    try:
        before = blas_threads()
        monkeypatch.setattr(os, 'cpu_count', lambda: 4)
        limit = cpu_threads.share_blas(8)
        try:
            assert blas_threads() == [1] * len(before)
        finally:
            limit.restore_original_limits()
        assert blas_threads() == before
    finally:
        gc.enable()
