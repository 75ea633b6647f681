"""Pure rewrites of a net and its weights: (NetParameter, weights) -> (NetParameter, weights).

``weights`` is {layer name: [numpy arrays]} in each layer's blob order, or None when only
the net is rewritten; a caffemodel path (binary or HDF5) is read on the way in. The
trainer, tools/convert_model.py and the tests share these functions.

  to_syncbn     BatchNorm(+Scale) and BN become SyncBN
  to_batchnorm  BN and SyncBN become BatchNorm + Scale, which stock Caffe and OpenCV run
  fold_bn       TEST-mode batch norms fold into the Convolution/InnerProduct before them
  to_deploy     a train_val or test net becomes a deploy net

The weights they take and give are fitted and copied by caffe_syncbn.weights; the
command line that writes their results is cli/convert.py.
"""
from .deploy import to_deploy
from .fold import fold_bn
from .norm import to_batchnorm, to_syncbn

__all__ = ['fold_bn', 'to_batchnorm', 'to_deploy', 'to_syncbn']
