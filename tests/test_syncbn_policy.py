"""SyncBN's policy is one module (syncbn_policy.py), and the mechanisms follow it: to_syncbn
converts what it names into the convention it names, the SyncBN layer accumulates in that
convention, the weight forms read it, asynchronous training refuses what it refuses, and
the loss normalizer of the global batch is its."""
import logging
import threading

import pytest
from google.protobuf import text_format

from caffe_syncbn import caffe_pb2, syncbn_policy
from caffe_syncbn.comm.thread import ThreadComm
from caffe_syncbn.convert import to_syncbn
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layer import TRAIN
from caffe_syncbn.layers.norm.array import RunningAverage, RunningSums
from caffe_syncbn.net import Net
from caffe_syncbn.weights.norm_forms import norm_units

BATCHNORM, MOMENTUM = caffe_pb2.BNParameter.BATCHNORM, caffe_pb2.BNParameter.MOMENTUM
INPUT = 'layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 4 dim: 3 } } }\n'

#: (a batch norm layer, the statistics of its SyncBN, whether it keeps sums, frozen)
FORMS = [
    ('type: "BatchNorm"', BATCHNORM, True, False),
    ('type: "BatchNorm" batch_norm_param { use_global_stats: true }', BATCHNORM, True, True),
    ('type: "BatchNorm" batch_norm_param { use_global_stats: false }', BATCHNORM, True, False),
    ('type: "BN"', MOMENTUM, False, False),
    ('type: "BN" bn_param { frozen: true }', MOMENTUM, False, True),
    ('type: "SyncBN"', MOMENTUM, False, False),
    ('type: "SyncBN" bn_param { statistics: BATCHNORM }', BATCHNORM, True, False),
]


def net_with(layer):
    return text_format.Parse(INPUT + 'layer { name: "bn" %s bottom: "x" top: "x" }' % layer,
                             caffe_pb2.NetParameter())


@pytest.mark.parametrize('layer, statistics, sums, frozen', FORMS)
def test_the_converter_the_layer_and_the_weight_forms_keep_the_statistics_it_names(
        layer, statistics, sums, frozen):
    param = net_with(layer)
    written = param.layer[1]
    assert syncbn_policy.syncbn_statistics(written) == statistics
    assert syncbn_policy.keeps_sums(written) == sums
    assert syncbn_policy.is_frozen(written) == frozen
    assert [u.keeps_sums for u in norm_units(param.layer)] == [sums]
    converted = to_syncbn(param)[0]
    made = converted.layer[1]
    assert made.type == 'SyncBN' and (written.type in syncbn_policy.CONVERTED
                                      or made == written)
    assert (made.bn_param.statistics, made.bn_param.frozen) == (statistics, frozen)
    assert syncbn_policy.keeps_sums(made) == sums
    syncbn = Net(converted, TRAIN).layers[1]
    assert isinstance(syncbn.statistics, RunningSums if sums else RunningAverage)
    assert len(syncbn.blobs) == (5 if sums else 4)


def test_other_layers_do_not_convert():
    param = net_with('type: "ReLU"')
    assert to_syncbn(param)[0] == param and norm_units(param.layer) == []


def test_the_loss_normalizer_alone_is_caffes_and_over_replicas_the_global_count():
    assert syncbn_policy.loss_normalizer(None, 0) == 1.0
    assert syncbn_policy.loss_normalizer(None, 6) == 6.0
    comms = ThreadComm.create(3)
    counts, results = [0, 4, 5], [None] * 3

    def replica(rank):
        results[rank] = syncbn_policy.loss_normalizer(comms[rank], counts[rank])
    threads = [threading.Thread(target=replica, args=(rank,)) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [pytest.approx(9.0 / 3)] * 3      # max(1, 0 + 4 + 5) / 3 replicas


def test_asynchronous_training_refuses_sync_bn_and_syncbn_layers_saying_why():
    with pytest.raises(CaffeError, match=r'^-async cannot run with -sync_bn: SyncBN normalizes '
                                         r'with the statistics of all replicas in the same step'):
        syncbn_policy.check_asynchronous(sync_bn=True)
    layers = list(net_with('type: "SyncBN"').layer) + list(net_with('type: "BatchNorm"').layer)
    with pytest.raises(CaffeError, match=r"^-async cannot train SyncBN layers \(bn\): .*; use "
                                         r'BatchNorm or BN$'):
        syncbn_policy.check_asynchronous(layers=layers)
    syncbn_policy.check_asynchronous(layers=[layer for layer in layers
                                             if layer.type != 'SyncBN'])


def test_the_start_lines_say_what_converts_and_how_it_keeps_its_statistics():
    param = text_format.Parse(INPUT + '''
layer { name: "bn1" type: "BatchNorm" bottom: "x" top: "x" }
layer { name: "sc1" type: "Scale" bottom: "x" top: "x" scale_param { bias_term: true } }
layer { name: "bn2" type: "BN" bottom: "x" top: "x" bn_param { frozen: true } }
''', caffe_pb2.NetParameter())
    assert syncbn_policy.start_lines(param, norm_units(param.layer)) == [
        (logging.INFO, '--sync-bn: 2 layer(s) run as SyncBN (1 BatchNorm+Scale, 1 BN)'),
        (logging.INFO, "--sync-bn: running statistics of the global batch, kept 1 as "
                       "BatchNorm's sums (moving_average_fraction) and 1 as a momentum average"),
        (logging.INFO, '--sync-bn: 1 of them keep their running statistics (use_global_stats: '
                       'true or frozen: true), as frozen SyncBN: bn2')]
    empty = net_with('type: "ReLU"')
    assert syncbn_policy.start_lines(empty, []) == [
        (logging.WARNING, "--sync-bn: net '' has no BatchNorm or BN layer; nothing is "
                          'synchronized')]
