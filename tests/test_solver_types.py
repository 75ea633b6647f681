"""Solver types come from one registry (training/rules.py): a rule registered there is a type
that solver files may name, with pycaffe's class, in the lists the errors give, and with
nothing else to edit."""
import numpy as np
import pytest
from test_solvers import batches

import caffe_syncbn
from caffe_syncbn.cli import main
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.pycaffe import caffe as pycaffe
from caffe_syncbn.training.rules import RULES, UpdateRule, solver_type
from caffe_syncbn.training.solvers import get_solver, get_solver_class

CAFFE_ORDER = ['SGD', 'Nesterov', 'AdaGrad', 'RMSProp', 'AdaDelta', 'Adam']


def test_the_types_are_caffes_in_its_order_each_with_pycaffes_class():
    assert list(RULES) == CAFFE_ORDER
    for name in CAFFE_ORDER:
        solver_class = get_solver_class(name)
        assert solver_class.__name__ == name + 'Solver'
        assert getattr(pycaffe, name + 'Solver') is solver_class
        assert getattr(caffe_syncbn, name + 'Solver') is solver_class
        assert solver_class.rule_class is RULES[name] and RULES[name].type_name == name
    for missing in ('Solver', 'DataParallelSolver', 'AdamaxSolver'):
        assert not hasattr(pycaffe, missing) and not hasattr(caffe_syncbn, missing)


def _solver_file(folder, type_name):
    (folder / 'net.prototxt').write_text('name: "n"\n')
    (folder / 'solver.prototxt').write_text('net: "net.prototxt"\nbase_lr: 0.1\n'
                                            'lr_policy: "fixed"\ntype: "%s"\n' % type_name)
    return 'solver.prototxt'


def test_an_unknown_type_is_one_error_naming_the_file_and_the_types(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _solver_file(tmp_path, 'Adamax')
    message = ("^solver.prototxt: unknown solver type 'Adamax'; expected one of SGD, Nesterov, "
               'AdaGrad, RMSProp, AdaDelta, Adam$')
    with pytest.raises(CaffeError, match=message):
        get_solver(path)
    with pytest.raises(CaffeError, match=message):            # before any device starts
        get_solver(path, devices='cpu:2')
    with pytest.raises(CaffeError, match=message):            # a class that forces a rule too
        pycaffe.AdamSolver(path)
    with pytest.raises(CaffeError, match=message):
        main(['upgrade', path, 'upgraded.prototxt'])
    assert not (tmp_path / 'upgraded.prototxt').exists()
    with pytest.raises(CaffeError, match="^unknown solver type 'Adamax'; expected one of SGD,"):
        get_solver_class('Adamax')


def test_a_type_registers_once():
    with pytest.raises(ValueError, match='solver type Adam is registered twice'):
        solver_type('Adam')(type('AnotherAdam', (UpdateRule,), {}))
    assert RULES['Adam'].__name__ == 'AdamRule'


@pytest.fixture
def sign_sgd():
    """A solver type added as a user's module would add it: sign SGD, w -= lr * sign(g)."""
    @solver_type('SignSGD')
    class SignRule(UpdateRule):
        def compute_update(self, i, blob, rate, iteration=0):
            blob.diff[...] = self.local_rate(i, rate) * blob.xp.sign(blob.diff)
    yield SignRule
    del RULES['SignSGD']


def test_one_registered_rule_is_a_solver_type_with_its_class(sign_sgd, tmp_path, monkeypatch):
    """The registered rule trains a solver file that names it, through pycaffe's entry point
    and its class; its step is lr * sign(g), with g from an SGD run of the same net."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'net.prototxt').write_text(CLASSIFIER)
    runs = {}
    for type_name in ('SGD', 'SignSGD'):
        (tmp_path / 'solver.prototxt').write_text(
            'net: "net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\nmax_iter: 1\n'
            'random_seed: 1\ntype: "%s"\n' % type_name)
        solver = pycaffe.get_solver('solver.prototxt')
        before = [blob.data.copy() for blob in solver.net.learnable_params]
        solver.set_data_source(batches(0))
        solver.step(1)
        runs[type_name] = solver, before
    (sgd, before), (sign, sign_before) = runs['SGD'], runs['SignSGD']
    assert type(sign) is pycaffe.SignSGDSolver is caffe_syncbn.SignSGDSolver
    assert type(sign).rule_class is sign_sgd
    for start, blob, signed_blob, start_again in zip(before, sgd.net.learnable_params,
                                                     sign.net.learnable_params, sign_before):
        np.testing.assert_array_equal(start, start_again)
        gradient = (start - blob.data) / np.float32(0.1)
        assert np.all(np.abs(gradient) > 1e-4), 'a zero gradient has no sign to check'
        np.testing.assert_allclose(signed_blob.data, start - np.float32(0.1) * np.sign(gradient),
                                   rtol=1e-6, atol=1e-7)


CLASSIFIER = """name: "classifier"
layer { name: "input" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 1 }
                        bias_filler { type: "gaussian" std: 1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
