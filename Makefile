# `make demo` and `make test` each set up .venv on a fresh machine, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test gpu-test gpu-check gpu-bundle proto-check clean kernel-asan kernel-tsan

$(STAMP): setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# NVIDIA's cuDNN frontend, for its graph API alone: the tests define the cuDNN engine's
	# graphs with it, which needs no GPU. Its dependencies (cutlass-dsl, ~180 MB) serve JIT
	# engines that the engine does not use. The same pin travels in tools/gpu_bundle.py.
	$(PY) -m pip install -q --no-deps 'nvidia-cudnn-frontend==1.32.0'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --timeout=600 -n auto tests

# the goldens must run there, not skip: they come from CAFFE_SYNCBN_SHARED, else the bundle of
# `make gpu-bundle`, else ../shared
gpu-test:
	CAFFE_SYNCBN_REQUIRE_DATA=1 PYTHONPATH=. python3 -m pytest -q -m gpu --timeout=900 tests

# Everything that needs a GPU, in two stages of one device call each (STAGE=1: the kernels,
# the GPU tests, the demo net trained on gpu:0,0 against cpu:2; STAGE=2: the GPU benchmarks;
# no STAGE: both); a report in $OUT, else out/gpu (docs/gpu.md, "make gpu-check"). Like
# gpu-test, it needs no registry and no venv.
gpu-check:
	PYTHONPATH=. python3 tools/gpu_check.py $(if $(STAGE),--stage $(STAGE)) $(GPU_CHECK_FLAGS)

# Before a device call: the goldens, corpus and wheels a GPU machine lacks, into the
# git-ignored .gpu-bundle/ that travels as `carry`; prints each stage's call (docs/gpu.md).
# It runs in the venv: it reads the plan of tools/gpu_check.py, which imports the package.
gpu-bundle: $(STAMP)
	$(PY) tools/gpu_bundle.py $(GPU_BUNDLE_FLAGS)

proto-check: $(STAMP)
	$(PY) tools/gen_proto.py --check

clean:
	rm -rf $(VENV) build *.egg-info

# The emulated kernel tests with the kernels built under AddressSanitizer: out-of-bounds and
# use-after-free accesses of device and __shared__ memory (CI runs it after `test`): the
# kernels' own tests, and in tests/layers those whose module, name or engine says cuda.
# Its time is mostly compiling: each kernel file is built under ASan once and cached (in
# $TMPDIR/caffe_syncbn_emu_<uid>, or CAFFE_SYNCBN_EMU_BUILD_DIR). On 2 cores at load
# averages of 8 to 11: 325 s from an empty cache (150 CPU seconds); from a full one, 30 CPU
# seconds with the tests of tests/layers (16 s at a load average of 2); divide the CPU
# seconds by the cores it gets for the wall time. The Python process preloads the ASan
# runtime, and --capture=sys leaves stderr alone so that a report reaches the terminal.
kernel-asan: $(STAMP)
	CAFFE_SYNCBN_EMU_SANITIZE=address ASAN_OPTIONS=detect_leaks=0 \
	LD_PRELOAD=$$(g++ -print-file-name=libasan.so) \
	$(PY) -m pytest -q -p no:cacheprovider --capture=sys -n 2 -k cuda tests/test_cuda_strict_*.py \
	tests/test_cuda_emulated_*.py tests/layers

# The same under ThreadSanitizer: each emulated CUDA thread is a TSan fiber that only
# barriers and shuffles order, so a missing __syncthreads or a plain += where an atomic is
# needed is reported as a data race between two threads of a block (the run's exit status is
# 66 then). Races between blocks are not seen: see docs/gpu-emulation.md. The kernels' tests
# only: test_cuda_strict_emulation.py runs broken kernels (one races on purpose), and TSan's
# shadow of the 64-bit tests' sparse arrays would need more memory than they map.
kernel-tsan: $(STAMP)
	CAFFE_SYNCBN_EMU_SANITIZE=thread LD_PRELOAD=$$(g++ -print-file-name=libtsan.so) \
	$(PY) -m pytest -q -p no:cacheprovider --capture=sys -n 2 tests/test_cuda_strict_syncbn.py \
	tests/test_cuda_strict_layers.py tests/test_cuda_strict_fused.py tests/test_cuda_strict_detection.py
