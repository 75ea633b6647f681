"""What the tests share: where the reference data lies (paths.py), arrays (arrays.py), the
run of a layer test on every engine (engines.py), hang detection (watchdog.py), the CUDA
emulation (cuda_emulation.py, emulated_gpu.py) and stand-ins (fake_nccl.py,
host_streams.py, counting_comm.py), net and ONNX builders, and the fuzz harness. The tests
folder is on sys.path (pytest puts conftest.py's folder there): ``from helpers import x``."""
