"""Train with a Python loss layer and a Python layer that learns a param (add_blob), feeding
Input blobs from Python before each step, as pycaffe scripts do.

usage: python_loss.py WORK VARIANT (VARIANT: python or builtin; WORK holds data.npz)
Writes VARIANT.npz: the loss after each step, the learned params, the test net's output.
"""
import caffe_syncbn
caffe_syncbn.install_as_caffe()

import os  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

import caffe  # noqa: E402

work, variant = sys.argv[1:3]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))      # pyloss_layers
LAYERS = {
    'python': """
layer { name: 'scale' type: 'Python' bottom: 'ip' top: 'scaled'
        python_param { module: 'pyloss_layers' layer: 'LearnedScaleLayer' } }
layer { name: 'loss' type: 'Python' bottom: 'scaled' bottom: 'target' top: 'loss'
        python_param { module: 'pyloss_layers' layer: 'EuclideanLossLayer' } loss_weight: 1 }""",
    'builtin': """
layer { name: 'scale' type: 'Scale' bottom: 'ip' top: 'scaled'
        scale_param { axis: 0 num_axes: 0 } }
layer { name: 'loss' type: 'EuclideanLoss' bottom: 'scaled' bottom: 'target' top: 'loss' }"""}
with open('%s/%s_net.prototxt' % (work, variant), 'w') as f:
    f.write("""name: 'regression'
layer { name: 'data' type: 'Input' top: 'data' top: 'target'
        input_param { shape { dim: 8 dim: 5 } shape { dim: 8 dim: 3 } } }
layer { name: 'ip' type: 'InnerProduct' bottom: 'data' top: 'ip'
        inner_product_param { num_output: 3 } }""" + LAYERS[variant])
with open('%s/%s_solver.prototxt' % (work, variant), 'w') as f:
    f.write("net: '%s/%s_net.prototxt' base_lr: 0.05 momentum: 0.9 weight_decay: 0.001 "
            "lr_policy: 'fixed' max_iter: 100 snapshot_after_train: false" % (work, variant))

data = np.load(work + '/data.npz')
solver = caffe.SGDSolver('%s/%s_solver.prototxt' % (work, variant))
solver.net.params['ip'][0].data[...] = data['w0']
losses = []
for it in range(6):
    solver.net.blobs['data'].data[...] = data['x'][it % 2]
    solver.net.blobs['target'].data[...] = data['y'][it % 2]
    solver.step(1)
    losses.append(solver.net.blobs['loss'].data.item())
np.savez('%s/%s.npz' % (work, variant), losses=losses, w=solver.net.params['ip'][0].data,
         b=solver.net.params['ip'][1].data, s=solver.net.params['scale'][0].data,
         iter=solver.iter)
