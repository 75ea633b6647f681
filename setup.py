from glob import glob

from setuptools import find_packages, setup

setup(
    name='caffe-syncbn',
    version='0.1.0',
    description='Caffe models on numpy/CuPy, trained data-parallel with synchronized batch norm',
    packages=find_packages(include=['caffe_syncbn', 'caffe_syncbn.*']),
    package_data={'caffe_syncbn': ['caffe.pb']},
    # the kernels' CUDA sources, where caffe_syncbn.cuda_kernels looks outside a source tree
    data_files=[('share/caffe_syncbn/cuda', sorted(glob('cuda/*.cu') + glob('cuda/*.cuh')))],
    python_requires='>=3.10',
    install_requires=['numpy>=1.23', 'protobuf>=4.21', 'h5py>=3.7', 'lmdb>=1.3', 'tqdm>=4.61', 'threadpoolctl>=3'],
    entry_points={'console_scripts': ['caffe-syncbn = caffe_syncbn.cli:console_main']},
    extras_require={
        # CuPy with its CUDA libraries (NVRTC, cuBLAS: the [ctk] extra) and NCCL, which the
        # cupy-cuda13x wheel alone does not bring
        'gpu': ['cupy-cuda13x[ctk]>=14', 'nvidia-nccl-cu13>=2.20'],
        # the cuDNN convolution engine (CAFFE_SYNCBN_CUDNN=1; docs/gpu.md): NVIDIA's frontend
        # and the cuDNN library it loads
        'cudnn': ['nvidia-cudnn-frontend>=1.32', 'nvidia-cudnn-cu13>=9'],
        # mpi4py and an MPI library from PyPI: the mpich wheel puts mpiexec in the environment
        # (an MPI already installed, e.g. a cluster's, works too: then pip install mpi4py alone)
        'mpi': ['mpi4py>=4', 'mpich>=4.2'],
        # -precision bfloat16: numpy's bfloat16 dtype
        'bfloat16': ['ml_dtypes>=0.2'],
        'plot': ['matplotlib>=3.5'],
        'images': ['opencv-python-headless<5'],
        'onnx': ['onnx>=1.14'],
        # caffe.draw: pydot for get_pydot_graph, graphviz-pure (a self-contained `dot`) for images
        'draw': ['pydot>=1.4', 'graphviz-pure>=0.2'],
        'test': ['pytest>=7', 'pytest-timeout>=2', 'pytest-xdist>=3', 'grpcio-tools>=1.60', 'opencv-python-headless<5',
                 'matplotlib>=3.5', 'scipy>=1.9', 'onnx>=1.14', 'onnxruntime>=1.16', 'pydot>=1.4',
                 'graphviz-pure>=0.2', 'mpi4py>=4', 'mpich>=4.2', 'hypothesis>=6', 'ml_dtypes>=0.2',
                 # libnvrtc alone (no GPU needed): tests/test_cuda_nvrtc.py compiles the kernels
                 # as CuPy does
                 'nvidia-cuda-nvrtc>=13,<14; sys_platform == "linux"'],
    },
)
