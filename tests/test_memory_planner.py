"""The Net is one class that owns a MemoryPlanner: the planner reads the net through its
NetWiring, never a private attribute; the plans, their description and the two defaults
are named once (memory_planner.py), and the Net, the solvers and the command line take
them from there."""
import ast
import inspect
import re
from pathlib import Path

import pytest

import caffe_syncbn as caffe
from caffe_syncbn import memory_planner
from caffe_syncbn.cli import commands
from caffe_syncbn.layer import Layer
from caffe_syncbn.memory_planner import DEFAULT_PLAN, PLANS, MemoryPlanner, NetWiring
from caffe_syncbn.net import Net
from caffe_syncbn.training.solvers import get_solver
from helpers.paths import ROOT
from test_data_parallel import solver_param

PACKAGE = Path(caffe.__file__).resolve().parent
#: pycaffe's own names of a Net, underscore and all
PYCAFFE_NAMES = {'_layer_names', '_blob_names'}


def test_the_net_is_one_class_whose_methods_are_all_in_net_py():
    assert [cls for cls in Net.__mro__ if cls is not object] == [Net]
    assert {getattr(Net, name).__module__ for name, value in vars(Net).items()
            if inspect.isfunction(value)} == {'caffe_syncbn.net'}


@pytest.mark.parametrize('module', ['memory_planner', 'net_batches', 'net_sharing'])
def test_the_net_helpers_read_no_private_attribute_of_another_object(module):
    """What the Net hands its planner and helpers goes through arguments and public names:
    an attribute with a leading underscore is read only on ``self``."""
    tree = ast.parse((PACKAGE / (module + '.py')).read_text())
    private = ['%s.%s (line %d)' % (ast.unparse(node.value), node.attr, node.lineno)
               for node in ast.walk(tree) if isinstance(node, ast.Attribute)
               and node.attr.startswith('_') and not node.attr.startswith('__')
               and node.attr not in PYCAFFE_NAMES
               and not (isinstance(node.value, ast.Name) and node.value.id == 'self')]
    assert private == []


def test_the_planner_plans_from_the_wiring_alone(tmp_path):
    """A planner made from the NetWiring of a net built under 'off' (no Net in hand) plans
    as the one a Net makes under the plan."""
    model = tmp_path / 'net.prototxt'
    model.write_text(RELU_CHAIN)
    planned = Net(str(model), caffe.TRAIN, memory_plan='auto')
    wiring = Net(str(model), caffe.TRAIN).planner.wiring
    assert isinstance(wiring, NetWiring)
    alone = MemoryPlanner('auto', wiring)
    assert alone.chains == planned.planner.chains and alone.chains[2] == [3, 4]
    assert (alone.chosen, alone.plan.arena.nbytes) == (planned.memory_plan,
                                                       planned.planner.plan.arena.nbytes)


def test_what_the_net_asks_of_a_layer_is_written_in_one_section_and_in_the_docs():
    """layer.py's section "what the Net asks" names every hook it holds, each a Layer
    attribute, and docs/architecture.md names the same ones."""
    source = (PACKAGE / 'layer.py').read_text()
    section = source[source.index('# ---- what the Net asks'):
                     source.index("# ---- what a layer's own steps use")]
    summary = ' '.join(line.strip('# ') for line in section.splitlines()
                       if line.strip().startswith('# '))
    defined = set(re.findall(r'^    def (\w+)\(', section, re.M)) | \
        set(re.findall(r'^    (\w+) = ', section, re.M))
    named = {word for word in re.findall(r'\b[a-z]+_[a-z_]+\b|\b(?:absorb|recompute|'
                                         r'recomputable|rerunnable|decided)\b', summary)
             if hasattr(Layer, word)}
    assert named == defined and len(defined) == 14
    docs = (ROOT / 'docs' / 'architecture.md').read_text()
    assert [name for name in sorted(defined) if not re.search(r'`%s\b' % name, docs)] == []


def test_every_default_comes_from_default_plan(monkeypatch, tmp_path):
    """The Net's signature, pycaffe's solvers and the commands read DEFAULT_PLAN, and nothing
    else names a default: change it and they follow."""
    assert inspect.signature(Net).parameters['memory_plan'].default == DEFAULT_PLAN['pycaffe']
    monkeypatch.setitem(DEFAULT_PLAN, 'pycaffe', 'share')
    assert get_solver(solver_param('SyncBN'), devices=None).net.memory_plan == 'share'
    model = tmp_path / 'net.prototxt'
    model.write_text(RELU_CHAIN)
    asked = []

    def timing_net(model, batch, phase, level, stages, memory_plan, input_shape=None):
        asked.append(memory_plan)
        raise caffe.CaffeError('stop here')
    monkeypatch.setattr(commands, 'build_timing_net', timing_net)
    monkeypatch.setitem(DEFAULT_PLAN, 'command', 'recompute')
    with pytest.raises(caffe.CaffeError, match='stop here'):
        commands.main(['time', '-model', str(model)])
    assert asked == ['recompute']


def test_the_help_of_memory_plan_says_what_plans_says():
    help_text = ' '.join(commands._parser('time').format_help().split())
    for name, text in PLANS.items():
        marked = name + (' (the default)' if name == DEFAULT_PLAN['command'] else '')
        assert '%s: %s' % (marked, ' '.join(text.split())) in help_text


def test_the_docs_name_the_defaults_that_default_plan_holds():
    memory = (ROOT / 'docs' / 'pycaffe-and-cli.md').read_text()
    assert "**`%s`** (pycaffe's" % DEFAULT_PLAN['pycaffe'] in memory
    assert '**`%s`** (the default of `caffe-syncbn train`' % DEFAULT_PLAN['command'] in memory
    assert 'at most %g of' % memory_planner.AUTO_SAVING in memory


RELU_CHAIN = '''name: "chain"
layer { name: "data" type: "Input" top: "data" top: "target"
        input_param { shape { dim: 2 dim: 3 dim: 4 dim: 4 } shape { dim: 2 dim: 4 dim: 1 dim: 1 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "scale" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
        pooling_param { pool: AVE global_pooling: true } }
layer { name: "loss" type: "EuclideanLoss" bottom: "pool" bottom: "target" top: "loss" }
'''
