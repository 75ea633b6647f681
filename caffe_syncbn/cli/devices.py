"""Devices as the caffe-syncbn command names them: -gpu ids or all, -cpu_devices N, a
solver's solver_mode, and device_query's report. Errors speak the command's flags."""
import logging
import os

from .. import caffe_pb2
from ..backend import gpu_count, set_device, set_mode_cpu, set_mode_gpu
from ..errors import CaffeError
from ..training.device_names import gpu_name

log = logging.getLogger('caffe_syncbn')


def train_devices(args, solver_param=None):
    """The devices argument of get_solver (and PreciseBN): -gpu, -cpu_devices, or the
    solver's solver_mode and device_id, which caffe train follows when -gpu is not given."""
    if args.gpu is not None:
        spec = gpu_spec(args.gpu, 'for virtual CPU devices use -cpu_devices N')
        allow_tf32(args)
        return 'gpu:' + spec
    if args.cpu_devices is not None:
        return 'cpu:%d' % args.cpu_devices
    if solver_param is not None and solver_param.HasField('solver_mode') and \
            solver_param.solver_mode == caffe_pb2.SolverParameter.GPU:
        if gpu_count():
            return 'gpu:%d' % solver_param.device_id
        log.warning('%s says solver_mode: GPU, but no GPU is available here (%s); training on '
                    'the CPU', args.solver, no_gpu_reason())
    return 'cpu:1'


def gpu_spec(gpu, instead='leave out -gpu to run on the CPU'):
    """'0,1' or 'all' for a -gpu value, once a GPU is known to be there; without one, the
    error suggests ``instead``."""
    shown = 'all' if gpu == 'all' else ','.join(map(str, gpu))
    count = gpu_count()
    if not count:
        raise CaffeError('-gpu %s: no GPU is available here (%s); %s'
                         % (shown, no_gpu_reason(), instead))
    missing = [] if gpu == 'all' else sorted({i for i in gpu if i >= count})
    if missing:
        raise CaffeError('-gpu %s: GPU %d does not exist (%d visible: 0 to %d)'
                         % (shown, missing[0], count, count - 1))
    return shown


def allow_tf32(args):
    """-tf32: CUPY_TF32=1, which CuPy's float32 GEMMs read at the first one and the cuDNN
    engine at each graph it builds; set before any net is."""
    if args.tf32:
        os.environ['CUPY_TF32'] = '1'


def no_gpu_reason():
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed: pip install 'caffe-syncbn[gpu]'"
    return 'CuPy sees no CUDA device'


def select_device(args):
    """pycaffe's set_mode_cpu/set_mode_gpu + set_device for the one net of test and time;
    returns caffe's lines that say which device, to log once the net is built (so that a
    bad net file stays a one-line error)."""
    if args.gpu is None:
        set_mode_cpu()
        return ['Use CPU.']
    gpu_spec(args.gpu)
    allow_tf32(args)
    ids = list(range(gpu_count())) if args.gpu == 'all' else args.gpu
    set_mode_gpu()
    set_device(ids[0])
    lines = ['Use GPU with device ID %d' % ids[0], 'GPU device name: %s' % gpu_name(ids[0])]
    if len(ids) > 1:
        lines.append('-gpu %s: one net runs on one device, GPU %d'
                     % (','.join(map(str, ids)), ids[0]))
    return lines


#: Caffe's DeviceQuery lines: (label, key of CUDA's device properties)
_GPU_PROPERTIES = [('Major revision number', 'major'), ('Minor revision number', 'minor'),
                   ('Name', 'name'), ('Total global memory', 'totalGlobalMem'),
                   ('Total shared memory per block', 'sharedMemPerBlock'),
                   ('Total registers per block', 'regsPerBlock'), ('Warp size', 'warpSize'),
                   ('Maximum memory pitch', 'memPitch'),
                   ('Maximum threads per block', 'maxThreadsPerBlock'),
                   ('Maximum dimension of block', 'maxThreadsDim'),
                   ('Maximum dimension of grid', 'maxGridSize'), ('Clock rate', 'clockRate'),
                   ('Total constant memory', 'totalConstMem'),
                   ('Texture alignment', 'textureAlignment'),
                   ('Concurrent copy and execution', 'deviceOverlap'),
                   ('Number of multiprocessors', 'multiProcessorCount'),
                   ('Kernel execution timeout', 'kernelExecTimeoutEnabled')]


def device_query(args):
    """caffe device_query: each -gpu's properties; without -gpu, the CPU and the GPU count."""
    if args.gpu is None:
        count = gpu_count()
        log.info('CPU: %d cores; -cpu_devices N trains on N virtual devices (threads)',
                 os.cpu_count() or 1)
        log.info('GPUs: %d%s', count, ' (-gpu all, or -gpu 0,1,..., for their details)' if count
                 else ' (%s)' % no_gpu_reason())
        return 0
    log.info('Querying GPUs %s', gpu_spec(args.gpu))
    import cupy
    for index in (range(gpu_count()) if args.gpu == 'all' else args.gpu):
        properties = cupy.cuda.runtime.getDeviceProperties(index)
        log.info('Device id:                     %d', index)
        for label, key in _GPU_PROPERTIES:
            if key not in properties:          # fields newer CUDA versions dropped
                continue
            value = properties[key]
            if isinstance(value, bytes):
                value = value.decode(errors='replace')
            if key in ('deviceOverlap', 'kernelExecTimeoutEnabled'):
                value = 'Yes' if value else 'No'
            if isinstance(value, (list, tuple)):
                value = ', '.join(map(str, value))
            log.info('%-31s%s', label + ':', value)
    return 0
