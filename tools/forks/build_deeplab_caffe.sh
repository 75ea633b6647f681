#!/usr/bin/env bash
# Build DeepLab v2's Caffe (github DrSleep/deeplab-public-ver2, a11f8a26, 2016-11-29: aquariusjay's
# deeplab-public-ver2 to July 2016) CPU-only, OpenBLAS, pycaffe for Python 3, on Debian 12 (bookworm): the
# reference of DeepLab's layers (Interp, SegAccuracy, ImageSegData) for tests/fork_golden/deeplab/. About
# 12 min on 2 busy cores (only the caffe library, the caffe tool and pycaffe are built).
#
# Usage:
#   1. mirror it with the search tool's fetch, source "github:DrSleep/deeplab-public-ver2": a bare git dir.
#   2. build_deeplab_caffe.sh THAT_GIT_DIR    (REF_DIR default $HOME/caffe-ref -> $REF_DIR/deeplab-caffe)
#   3. PYTHONPATH=$REF_DIR/deeplab-caffe/python python3 -c 'import caffe'
# Installs the Debian packages of build_ref_caffe.sh plus libmatio-dev (SKIP_APT=1 skips).
#
# Local source fixes (all idempotent; those of build_segnet_caffe.sh, plus MAT-file I/O in CMake):
#   1. protobuf >= 3.6: CodedInputStream::SetTotalBytesLimit takes one argument (src/caffe/util/io.cpp).
#   2. Debian names Boost.Python "boost_python3XY" (cmake/Dependencies.cmake).
#   3. OpenCV 4 removed the C API names: CV_LOAD_IMAGE_COLOR/GRAYSCALE -> cv::IMREAD_COLOR/GRAYSCALE
#      (io.cpp, window_data_layer.cpp, test_io.cpp).
#   4. python/caffe/io.py: scikit-image optional.
#   5. python/caffe/pycaffe.py: dict.iteritems() -> dict.items() (Python 3; Net.forward/backward call it).
#   6. The fork's Makefile links libmatio (MatRead, MatWrite) and its CMake does not: Dependencies.cmake
#      appends matio to Caffe_LINKER_LIBS.
#   7. include/caffe/util/interp.hpp includes cublas_v2.h whatever CPU_ONLY says, and uses nothing of it:
#      the include is kept for GPU builds only.
set -euo pipefail
REF_DIR="${REF_DIR:-$HOME/caffe-ref}"
DIR="$REF_DIR/deeplab-caffe"
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-python3}"

if [ "${SKIP_APT:-0}" != 1 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
    build-essential cmake git \
    libboost-system-dev libboost-thread-dev libboost-filesystem-dev libboost-python-dev \
    libgoogle-glog-dev libgflags-dev libprotobuf-dev protobuf-compiler \
    libhdf5-dev libopenblas-dev liblmdb-dev libleveldb-dev libsnappy-dev \
    libopencv-dev python3-dev python3-numpy libmatio-dev
fi

if [ $# -ge 1 ] && [ -n "$1" ]; then
  mkdir -p "$DIR"
  git --git-dir="$1" archive HEAD | tar -x -C "$DIR"
  git --git-dir="$1" rev-parse HEAD > "$DIR/FORK_COMMIT"
fi
[ -f "$DIR/src/caffe/layers/interp_layer.cpp" ] || { echo "no DeepLab v2 fork source at $DIR" >&2; exit 1; }
cd "$DIR"

# (1) protobuf 3.6+
sed -i 's/SetTotalBytesLimit(kProtoReadBytesLimit, 536870912)/SetTotalBytesLimit(kProtoReadBytesLimit)/' \
  src/caffe/util/io.cpp
# (2) Boost.Python naming
sed -i -e 's/"python-py\${boost_py_version}"/"python${boost_py_version}"/g' \
       -e 's/Boost_PYTHON-PY\${boost_py_version}_FOUND/Boost_PYTHON${boost_py_version}_FOUND/g' \
  cmake/Dependencies.cmake
# (3) OpenCV 4
sed -i -e 's/CV_LOAD_IMAGE_COLOR/cv::IMREAD_COLOR/g' -e 's/CV_LOAD_IMAGE_GRAYSCALE/cv::IMREAD_GRAYSCALE/g' \
  src/caffe/util/io.cpp src/caffe/layers/window_data_layer.cpp src/caffe/test/test_io.cpp
# (4) optional scikit-image
if grep -q '^import skimage.io$' python/caffe/io.py; then
  python3 - python/caffe/io.py <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
s = s.replace("import skimage.io\n", "try:\n    import skimage.io\nexcept ImportError:  # scikit-image is optional\n    skimage = None\n", 1)
s = s.replace("from skimage.transform import resize\n", "try:\n    from skimage.transform import resize\nexcept ImportError:\n    resize = None\n", 1)
open(p, "w").write(s)
PY
fi
# (5) Python 3
sed -i 's/\.iteritems()/.items()/g' python/caffe/pycaffe.py
# (6) libmatio
grep -q 'APPEND Caffe_LINKER_LIBS matio' cmake/Dependencies.cmake || \
  printf '\n# MatRead / MatWrite (the fork\x27s Makefile: USE_MATIO)\nlist(APPEND Caffe_LINKER_LIBS matio)\n' \
  >> cmake/Dependencies.cmake
# (7) CPU_ONLY without CUDA's headers
grep -q '^#ifndef CPU_ONLY' include/caffe/util/interp.hpp || \
  sed -i 's|^#include <cublas_v2.h>$|#ifndef CPU_ONLY\n#include <cublas_v2.h>\n#endif|' include/caffe/util/interp.hpp
[ "${SKIP_BUILD:-0}" = 1 ] && exit 0

PY_EXE="$("$PYTHON" -c 'import sys; print(sys.executable)')"
PY_INC="$("$PY_EXE" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
PY_LIB="$("$PY_EXE" -c 'import sysconfig, os; print(os.path.join(sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")))')"
mkdir -p build && cd build
cmake .. -DCMAKE_BUILD_TYPE=Release -DCPU_ONLY=ON -DBLAS=Open \
  -DUSE_OPENCV=ON -DUSE_LMDB=ON -DUSE_LEVELDB=ON \
  -DBUILD_python=ON -Dpython_version=3 -DBUILD_docs=OFF -DBUILD_matlab=OFF \
  -DPYTHON_EXECUTABLE="$PY_EXE" -DPYTHON_INCLUDE_DIR="$PY_INC" -DPYTHON_LIBRARY="$PY_LIB"
nice -n 10 make -j"$JOBS" caffe.bin pycaffe
cd "$DIR"
"$PY_EXE" -c "import google.protobuf" 2>/dev/null || [ "${SKIP_PIP:-0}" = 1 ] || "$PY_EXE" -m pip install -q protobuf
./build/tools/caffe --version 2>/dev/null || ./build/tools/caffe help 2>&1 | head -1
PYTHONPATH="$DIR/python" "$PY_EXE" -c 'import caffe; print("pycaffe OK:", caffe.__file__)'
