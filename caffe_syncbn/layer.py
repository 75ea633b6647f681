"""The Layer contract and the registry of layer types by their Caffe type name.

Every layer has four steps, as in Caffe:
  setup(bottom, top)      once: read the params, create ``self.blobs`` (learnable params)
  reshape(bottom, top)    size the tops for the current bottom shapes (called before every forward)
  forward(bottom, top)    top.data from bottom.data
  backward(top, propagate_down, bottom)
                          bottom[i].diff (overwritten) for each i with propagate_down[i];
                          param diffs are ACCUMULATED (+=) into self.blobs[j].diff, so that
                          several backward passes sum up as in Caffe (iter_size, shared params).
``bottom`` and ``top`` are lists of Blob. A top may be the same Blob as a bottom (in-place).
"""
import numpy as np

from .backend import get_array_module
from .blob import Blob
from .caffe_pb2 import TEST, TRAIN  # noqa: F401  (the phases, as pycaffe names them here)
from .errors import CaffeError, layer_error, quote
from .fillers import fill
from .forks import close_names, fork_of_layer_type, instead_of_layer_type

_REGISTRY = {}
#: type name -> [(test of a LayerParameter, class)]: forks' layers that share a type name
_VARIANTS = {}


def register(*type_names):
    """Class decorator: make a Layer class buildable under the given Caffe type names."""
    def add(cls):
        for name in type_names:
            if name in _REGISTRY:
                raise ValueError('layer type %r registered twice' % name)
            _REGISTRY[name] = cls
        return cls
    return add


def register_variant(type_name, applies):
    """Class decorator: build this class instead of the one registered under ``type_name``
    for a LayerParameter that ``applies(param)`` holds for. Two forks gave one type name
    to different layers (SegNet's BN and PSPNet's), told apart by their settings."""
    def add(cls):
        _VARIANTS.setdefault(type_name, []).append((applies, cls))
        return cls
    return add


def layer_type_list():
    return sorted(_REGISTRY)


def layer_class(type_name, param=None):
    try:
        return _REGISTRY[type_name]
    except KeyError:
        where = ('layer %s: ' % quote(param.name)) if param is not None else ''
        fork = fork_of_layer_type(type_name)
        if fork is not None:
            instead = instead_of_layer_type(type_name)
            error = CaffeError('%slayer type %s is from %s and is not implemented%s'
                               % (where, quote(type_name), fork,
                                  '; %s' % instead if instead else ''))
        else:
            close = close_names(type_name, _REGISTRY)
            hint = ('; did you mean %s?' % ', '.join(repr(c) for c in close)) if close else ''
            error = CaffeError('%sunknown layer type %s%s (known types: see layer_type_list())'
                               % (where, quote(type_name), hint))
        error.layer = param.name if param is not None else None    # its line, in a net file
        raise error from None


def create_layer(param, ctx):
    """Build the layer that ``param`` (a LayerParameter) describes, in context ``ctx``."""
    cls = layer_class(param.type, param)
    for applies, variant in _VARIANTS.get(param.type, ()):
        if applies(param):
            cls = variant
            break
    return cls(param, ctx)


class LayerContext:
    """What a layer may know about the place it runs in.

    phase:  TRAIN (0) or TEST (1)
    xp:     numpy or cupy
    dtype:  the float type of the params (and their diffs), the inputs, labels and losses;
            of every blob, unless ``activation_dtype`` says otherwise
    activation_dtype: under mixed precision, the half type (float16, bfloat16) of the
            blobs that the learned layers' outputs flow through, and of their diffs (the
            Net types each top: Layer.full_precision_top); ``dtype`` alone otherwise
    comm:   the Communicator that joins the replicas of a data-parallel run (None alone)
    group_comm: the Communicator of the replicas SyncBN layers share batch statistics with:
            ``comm`` itself, unless sync_bn_group_size splits the replicas into groups
    rng:    this replica's numpy RandomState (dropout masks, data shuffling)
    feeder: the input pipeline's batch for this replica, for data layers (None outside a solver)
    cuda_kernels: layers that have a kernel in cuda/ run it (default: when xp is CuPy); the
            tests switch it on over numpy arrays with an emulation of the kernels
    """

    def __init__(self, phase=TRAIN, xp=np, dtype=np.float32, comm=None, rng=None, feeder=None,
                 cuda_kernels=None, group_comm=None, activation_dtype=None):
        self.phase = phase
        self.xp = xp
        self.cuda_kernels = xp is not np if cuda_kernels is None else cuda_kernels
        self.dtype = np.dtype(dtype)
        self.activation_dtype = np.dtype(activation_dtype or dtype)
        if self.activation_dtype.name == 'bfloat16' and xp is not np:
            raise CaffeError('bfloat16 runs on the CPU: CuPy has no bfloat16 arrays (use '
                             '-precision float16 on GPUs)')
        self.comm = comm
        self.group_comm = group_comm if group_comm is not None else comm
        self.rng = rng if rng is not None else np.random.RandomState()
        self.feeder = feeder
        #: the device checks of this pass (check_later) that the Net has not read yet
        self.pending_checks = []
        #: the device values of this pass (read_later) that the Net has not read yet
        self.pending_reads = []

    @property
    def replicas(self):
        return self.comm.size if self.comm is not None else 1

    def check_later(self, layer, failed, message):
        """Raise ``layer.error(message())`` if ``failed`` holds: at once for a host value;
        for a 0-d bool array of a device, when the Net reads the pass's loss, with every
        other check of the pass in one read, not a read (a wait for the device) each."""
        if get_array_module(failed) is np:
            if failed:
                raise layer.error(message())
            return
        self.pending_checks.append((failed, layer, message))

    def read_later(self, value, receive):
        """``receive(value)`` with the host copy of a 0-d ``value``: at once for a host value;
        for a device's, when the Net reads the pass's loss, in that one read (a layer's
        count of what it did on the device, such as a skipped update)."""
        if get_array_module(value) is np:
            receive(value)
            return
        self.pending_reads.append((value, receive))


class BlobVec(list):
    """A layer's learnable blobs: a list, plus pycaffe's ``add_blob(*shape)``, with which a
    Python layer's ``setup`` creates its params (zero-filled, in the layer's dtype and backend)."""

    def __init__(self, xp, dtype):
        super().__init__()
        self.xp, self.dtype = xp, dtype

    def add_blob(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = shape[0]
        self.append(Blob(shape, self.dtype, self.xp))


class Layer:
    """Base class of every layer, the built-in ones and user ``Python`` layers alike."""

    def __init__(self, param, ctx=None):
        self.param = param
        self.ctx = ctx if ctx is not None else LayerContext()
        self.phase = self.ctx.phase
        self.blobs = BlobVec(self.xp, self.dtype)
        #: set by the Net: whether each learnable blob wants a gradient (lr_mult != 0)
        self.param_propagate_down = []

    @property
    def type(self):
        return self.param.type

    @property
    def name(self):
        return self.param.name

    @property
    def xp(self):
        return self.ctx.xp

    @property
    def dtype(self):
        return self.ctx.dtype

    @property
    def cuda_kernels(self):
        """Whether this layer runs its CUDA kernels (see LayerContext): the layer picks its
        engine by it at setup."""
        return self.ctx.cuda_kernels

    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        raise NotImplementedError

    def forward(self, bottom, top):
        raise NotImplementedError

    def backward(self, top, propagate_down, bottom):
        pass

    # ---- what the Net asks ----------------------------------------------------------------
    # The Net and its MemoryPlanner (memory_planner.py) ask a layer only what this section
    # holds; each default suits a layer that knows nothing of it. While the net is built:
    # is_loss, fixed_param_mults, allow_force_backward, full_precision_top. For memory:
    # backward_runs (what the forward need not keep); under every plan but 'off',
    # tops_persist and backward_reads; under 'inplace_abn' and the plans built on it, absorb
    # and output_survives; under 'recompute', recomputable, recompute and rerunnable. Before
    # each pass: before_pass, then decided.

    #: top 0 of a loss layer gets loss_weight 1 unless the prototxt says otherwise
    is_loss = False
    #: set by the Net: False when this layer's backward never runs (it leads to no loss and
    #: backward is not forced, or a memory plan runs the net forward only), so its forward
    #: need not keep what only the backward reads
    backward_runs = True
    #: True for a layer that writes its tops once and whose later forwards rely on them
    #: (DummyData's constant fillers): a memory plan gives its tops storage of their own
    tops_persist = False
    #: set by the memory planner on a layer that absorbed others (``absorb``): whether the
    #: chain's output stays as the chain wrote it until the chain's backward (no later
    #: layer writes that blob in place)
    output_survives = False

    def full_precision_top(self, index):
        """Under mixed precision, whether top ``index`` keeps the net's full dtype
        (``ctx.dtype``) where its values would take the half ``activation_dtype``: True for
        tops that hold exact values (indices, counts, accuracies), which half precision
        would round. The Net keeps the tops of layers without bottoms (the inputs and
        labels) and those with a loss weight in the full dtype on its own."""
        return False

    def fixed_param_mults(self, index):
        """(lr_mult, decay_mult) this layer imposes on blob ``index`` whatever the prototxt
        says (None in either place keeps the prototxt's value), or None. BatchNorm's
        statistics, for example, are never learned."""
        return None

    def allow_force_backward(self, bottom_index):
        """False for inputs that are indices or selectors, which have no gradient."""
        return True

    def absorb(self, layer, top):
        """Offered under a memory plan that absorbs chains ('inplace_abn' and the plans
        built on it): ``layer`` follows this one (or the last layer it absorbed) in a
        chain: its only bottom is the chain's output, which no other layer reads and the
        user did not ask to keep, and ``top`` is its only top. Return True to take its
        forward and backward into this layer's: the Net then runs neither; this layer
        writes ``top``, reads its diff, and accumulates ``layer``'s param diffs as
        ``layer`` would."""
        return False

    def backward_reads(self, bottom, top):
        """The blobs whose data this layer's backward reads: a memory plan may give the
        others' storage to later blobs once the forward is past them. Every bottom and
        top, unless the layer knows better."""
        return list(bottom) + list(top)

    def recomputable(self, bottom, top):
        """The tops this layer can write again in its backward from what it keeps, not
        from its bottoms (which may be gone by then): a memory plan 'recompute' frees them
        after the forward and calls ``recompute`` before the first backward that reads
        them. None, unless the layer can."""
        return []

    def recompute(self, top):
        """Write ``top``'s data again, as the last forward wrote it."""
        raise NotImplementedError

    def rerunnable(self):
        """Whether a second forward on the same bottoms writes the same tops and changes
        nothing a later step reads differently (no statistics, no random numbers): a
        memory plan 'recompute' may then let this layer's one top go after the forward
        and run the forward again before the first backward that reads the top, where
        keeping the bottoms until then costs less than keeping the top."""
        return False

    def before_pass(self):
        """A 1-D array of values this layer's next forward decides by, or None. The Net
        reads every layer's at once at the start of a pass and hands each its host copy
        (``decided``): on a GPU, one read while the device is idle rather than a wait for
        the device inside each forward."""
        return None

    def decided(self, values):
        """The host copy of what ``before_pass`` returned, before the pass's forward."""

    # ---- what a layer's own steps use ---------------------------------------------------
    #: the running-statistics updates this layer skipped because the statistics of its
    #: batch were not finite (SyncBN), counted as the passes are read; the solver takes
    #: and reports them (training/solver_checks.py)
    skipped_statistics = 0

    def wants_param_gradient(self, index):
        """Whether learnable blob ``index`` gets a gradient (the Net turns it off for
        lr_mult 0; a layer built outside a Net has no flags and wants them all)."""
        flags = self.param_propagate_down
        return index >= len(flags) or bool(flags[index])

    def error(self, message):
        return layer_error(self.param, message)

    def check_bottoms(self, bottom, exact=None, minimum=None, maximum=None):
        n = len(bottom)
        if (exact is not None and n != exact) or (minimum is not None and n < minimum) or \
                (maximum is not None and n > maximum):
            want = exact if exact is not None else '%s..%s' % (minimum, maximum)
            raise self.error('expects %s bottom blob(s), got %d' % (want, n))

    def check_tops(self, top, exact=None, minimum=None, maximum=None):
        n = len(top)
        if (exact is not None and n != exact) or (minimum is not None and n < minimum) or \
                (maximum is not None and n > maximum):
            want = exact if exact is not None else '%s..%s' % (minimum, maximum)
            raise self.error('expects %s top blob(s), got %d' % (want, n))

    def make_blob(self, shape, filler=None):
        """A new learnable blob of this layer's dtype and backend, filled by ``filler``."""
        blob = Blob(shape, self.dtype, self.xp)
        if filler is not None:
            fill(filler, blob)
        return blob
