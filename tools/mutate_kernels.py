#!/usr/bin/env python3
"""Mutation check of the CUDA kernel tests: applies one generic mutation at a time to a scratch
copy of cuda/ and runs the emulated kernel tests against it (tests/helpers/cuda_emulation.py builds
from CAFFE_SYNCBN_EMU_CUDA_DIR). A mutant is killed when a test fails (or hangs past the
timeout, as a GPU watchdog would stop it); it is stillborn when g++ rejects it; it survives
otherwise. A survivor of the plain emulation is run again under ThreadSanitizer (races inside a
block) or AddressSanitizer (out-of-bounds accesses), as SANITIZERS says, before it counts as
surviving. Survivors listed in EQUIVALENT below are equivalent mutants (no test can tell them
apart from the original on any input the kernel's contract allows), with the reason.

    tools/mutate_kernels.py                 # every mutant, 2 at a time
    tools/mutate_kernels.py --list          # the mutants, without running them
    tools/mutate_kernels.py --file lrn.cu --operator acc_in_storage_type
    tools/mutate_kernels.py --markdown      # the survivors as docs/gpu-emulation.md's table

Operators: drop_syncthreads, shuffle_offset, bound_off_by_one, drop_alignment, narrow_index,
acc_in_storage_type (accumulate rounded to the storage type T instead of acc_t<T>),
atomic_to_plain.
"""
import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA = ROOT / 'cuda'
STRICT = ['tests/test_cuda_strict_syncbn.py', 'tests/test_cuda_strict_layers.py',
          'tests/test_cuda_strict_fused.py', 'tests/test_cuda_strict_index64.py',
          'tests/test_cuda_strict_emulation.py', 'tests/test_cuda_strict_detection.py']
#: the tests that launch each file's kernels (common.cuh: all of them)
TESTS = {
    'norm.cu': ['tests/test_cuda_strict_syncbn.py', 'tests/test_cuda_strict_fused.py',
                'tests/test_cuda_strict_index64.py'],
    'eltwise.cu': ['tests/test_cuda_strict_fused.py', 'tests/test_cuda_strict_index64.py'],
    'detection.cu': ['tests/test_cuda_strict_detection.py', 'tests/test_cuda_strict_index64.py'],
    'common.cuh': STRICT,
}
_LAYER_TESTS = ['tests/test_cuda_strict_layers.py', 'tests/test_cuda_strict_index64.py']
#: -k expressions that pick a layer file's tests
SELECT = {'pooling.cu': 'pooling', 'lrn.cu': 'lrn', 'interp.cu': 'interp or pooling_and_im2col',
          'comm_sum.cu': 'reduce', 'loss.cu': 'softmax', 'conv.cu': 'im2col',
          'detection.cu': 'decode_boxes or jaccard', 'eltwise.cu': 'eltwise'}

#: the sanitizers that can see what a survivor of each operator breaks: a race inside a block
#: (ThreadSanitizer), an access out of bounds (AddressSanitizer). The ThreadSanitizer run
#: takes the tests of kernels with barriers, shuffles or atomics only (RACY), in one order.
SANITIZERS = {'drop_syncthreads': (('tsan', 'thread'),), 'shuffle_offset': (('tsan', 'thread'),),
              'atomic_to_plain': (('tsan', 'thread'),), 'bound_off_by_one': (('asan', 'address'),)}
RACY = '(local_stats or backward_reduce or interp or bn_relu_backward) and not reverse and not random'
_GRID_STRIDE = ('for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < (n); '
                't += (i64)blockDim.x * gridDim.x)')
_STRIDE = ('the stride blockDim*gridDim computed in 32 bits: it wraps only when a grid has '
           '2^32 threads or more, and the launch shape (grid <= 32*SMs blocks of 256) keeps it '
           'below 2^23')
_PROMOTED = 'the other factor is i64, so the product is 64-bit all the same'
_AT_EQUALITY = 'both branches give the same value where the two sides are equal'
_PLANE = ("an offset inside one plane: pooling.cu's contract is H*W and OH*OW < 2^31 "
          "(MAX's int32 index), so it fits an int")
#: (file, operator, original line stripped, occurrence in that line) -> why no test can kill it
EQUIVALENT = {
    ('norm.cu', 'narrow_index', _GRID_STRIDE, 1): _STRIDE,
    ('eltwise.cu', 'narrow_index', _GRID_STRIDE, 1): _STRIDE,
    ('detection.cu', 'narrow_index', _GRID_STRIDE, 1): _STRIDE,
    ('detection.cu', 'bound_off_by_one', 'return w < A(0) || h < A(0) ? A(0) : w * h;', 0):
        'at w = 0 the size w*h is 0 all the same',
    ('detection.cu', 'bound_off_by_one', 'return w < A(0) || h < A(0) ? A(0) : w * h;', 1):
        'at h = 0 the size w*h is 0 all the same',
    ('detection.cu', 'bound_off_by_one',
     'const A w = (u2 < v2 ? u2 : v2) - (u0 > v0 ? u0 : v0);', 0): _AT_EQUALITY,
    ('detection.cu', 'bound_off_by_one',
     'const A w = (u2 < v2 ? u2 : v2) - (u0 > v0 ? u0 : v0);', 1): _AT_EQUALITY,
    ('detection.cu', 'bound_off_by_one',
     'const A h = (u3 < v3 ? u3 : v3) - (u1 > v1 ? u1 : v1);', 0): _AT_EQUALITY,
    ('detection.cu', 'bound_off_by_one',
     'const A h = (u3 < v3 ? u3 : v3) - (u1 > v1 ? u1 : v1);', 1): _AT_EQUALITY,
    ('interp.cu', 'narrow_index', _GRID_STRIDE, 1): _STRIDE,
    ('lrn.cu', 'narrow_index', _GRID_STRIDE, 1): _STRIDE,
    ('pooling.cu', 'narrow_index', _GRID_STRIDE, 1): _STRIDE,
    ('loss.cu', 'narrow_index', _GRID_STRIDE, 1): _STRIDE,
    ('conv.cu', 'narrow_index', 't += (i64)blockDim.x * gridDim.x) {', 0): _STRIDE,
    ('comm_sum.cu', 'narrow_index', 'const i64 stride = (i64)blockDim.x * gridDim.x * width;', 0):
        _STRIDE + '; reduce_sum8 with accumulate kills it (an element added twice), '
                  'reduce_copy copies the same value again',
    ('norm.cu', 'bound_off_by_one',
     '__device__ __forceinline__ A relu(A v, A slope) { return v > A(0) ? v : v * slope; }', 0):
        'at v = 0 both give 0',
    ('eltwise.cu', 'bound_off_by_one',
     '__device__ __forceinline__ A relu(A v, A slope) { return v > A(0) ? v : v * slope; }', 0):
        'at v = 0 both give 0',
    ('norm.cu', 'bound_off_by_one',
     'const double inv_m = 1.0 / (count[0] > 1.0 ? count[0] : 1.0);', 0): _AT_EQUALITY,
    ('norm.cu', 'narrow_index', 'const i64 count = (i64)N * HW;', 0): _PROMOTED,
    ('norm.cu', 'narrow_index', 'const i64 slot = ((i64)c * splits + blockIdx.x) * 2;', 0):
        'c*splits + b indexes the partial buffer (2*C*splits doubles): past 2^31 only for a '
        'buffer of 32 GiB',
    ('conv.cu', 'narrow_index', 'sum += to_float(columns[((i64)kh * g.KW + kw) * plane + '
     '(i64)(hs / g.SH) * g.OW + ws / g.SW]);', 0):
        'kh*KW + kw < KH*KW is small; its product with plane is 64-bit',
    ('lrn.cu', 'narrow_index', 'GRID_STRIDE(t, (i64)N * HW) {', 0): _PROMOTED,
    ('pooling.cu', 'narrow_index',
     'const T* plane = x + (t / ((i64)g.OH * g.OW)) * g.H * g.W;', 0): _PLANE,
    ('pooling.cu', 'narrow_index', 'const i64 offset = (t / ((i64)g.H * g.W)) * g.OH * g.OW;', 0):
        _PLANE,
    ('pooling.cu', 'narrow_index', 'const i64 o = offset + (i64)oh * g.OW + ow;', 0): _PLANE,
    ('pooling.cu', 'narrow_index',
     'const T* grad = dy + (t / ((i64)g.H * g.W)) * g.OH * g.OW;', 0): _PLANE,
    ('comm_sum.cu', 'bound_off_by_one',
     'for (int k = 0; k < 8; ++k) vec = vec && (k >= nsrc || aligned16(src[k]));', 1):
        'it only chooses between the vector and the scalar path, which give the same values '
        '(and an unused pointer is null, hence aligned)',
    ('comm_sum.cu', 'bound_off_by_one',
     'for (int k = 0; k < 8; ++k) vec = vec && (k >= nsrc || aligned16(src[k]));', 0):
        'k = 8 >= nsrc (nsrc <= 8) short-circuits before src[8] would be read',
    ('comm_sum.cu', 'bound_off_by_one', 'for (int k = 0; k < 8; ++k) {', 0):
        'k = 8 >= nsrc (nsrc <= 8) always takes the loop\'s `continue`',
    ('loss.cu', 'narrow_index', 'GRID_STRIDE(t, (i64)outer * inner) {', 0): _PROMOTED,
    ('loss.cu', 'narrow_index',
     'const i64 i = t % inner, o = t / ((i64)classes * inner);', 0): _PROMOTED,
    ('norm.cu', 'narrow_index',
     'return ((i64)n * C + c) * HW + (i64)(j - n * row_len) * width;', 0):
        'n*C + c < N*C fits an int; its product with HW (i64) is 64-bit',
    ('norm.cu', 'narrow_index',
     'return ((i64)n * C + c) * HW + (i64)(j - n * row_len) * width;', 1):
        'j - n*row_len < HW/width, and local_stats/backward_reduce need N*HW < 2^31',
    ('norm.cu', 'narrow_index', 'const i64 slot = ((i64)blockIdx.y * splits + blockIdx.x) * 2;', 0):
        'c*splits + b indexes the partial buffer (2*C*splits doubles): past 2^31 only for a '
        'buffer of 32 GiB',
    ('norm.cu', 'narrow_index', 's1 += partial[((i64)c * splits + b) * 2];', 0):
        'the same index into the partial buffer',
    ('norm.cu', 'narrow_index', 's2 += partial[((i64)c * splits + b) * 2 + 1];', 0):
        'the same index into the partial buffer',
    ('norm.cu', 'narrow_index', 'const A p = to_float(x[(i64)s.c * HW]);', 0): _PROMOTED,
    ('norm.cu', 'bound_off_by_one',
     'const double inv_m = sums ? 1.0 / (count[0] > 1.0 ? count[0] : 1.0) : 0.0;', 0):
        _AT_EQUALITY,
    ('norm.cu', 'bound_off_by_one', 'if (total < INDEX32_LIMIT)' + ' ' * 61 + '\\', 0):
        'at total = 2^31 the 32-bit path still holds every index (< 2^31), and with the launch '
        "shape's stride every sum of index and stride",
    ('norm.cu', 'narrow_index', 'constexpr i64 INDEX32_LIMIT = (i64)1 << 31;', 0):
        'the limit becomes -2^31, so every size takes the 64-bit index path: the same values',
    ('loss.cu', 'bound_off_by_one', 'top = v > top ? v : top;', 0): _AT_EQUALITY,
    ('loss.cu', 'bound_off_by_one',
     'loss[t] = -log_acc(pl > (A)FLT_MIN_VALUE ? pl : (A)FLT_MIN_VALUE);', 0): _AT_EQUALITY,
}


class Mutant:
    def __init__(self, path, operator, line_number, occurrence, before, after):
        self.path, self.operator, self.line_number = path, operator, line_number
        self.occurrence, self.before, self.after = occurrence, before, after
        self.status, self.detail, self.seconds = None, '', 0.0

    @property
    def key(self):
        return (self.path, self.operator, self.before.strip(), self.occurrence)

    @property
    def name(self):
        return '%s:%d %s#%d' % (self.path, self.line_number, self.operator, self.occurrence)


def _subst(pattern, replace):
    """An operator that rewrites each match of pattern in a line, one mutant per match."""
    regex = re.compile(pattern)

    def mutate(line):
        for match in regex.finditer(line):
            new = match.expand(replace) if isinstance(replace, str) else replace(match)
            yield line[:match.start()] + new + line[match.end():]
    return mutate


def _drop_syncthreads(line):
    if re.search(r'__syncthreads\(\)\s*;', line):
        yield re.sub(r'__syncthreads\(\)\s*;', '', line, count=1)


def _guard(line):
    """Loop and branch conditions: `<` -> `<=`, `>=` -> `>`, `<=` -> `<`, `>` -> `>=`."""
    if not re.search(r'\bfor\s*\(|\bif\s*\(|\bwhile\s*\(|GRID_STRIDE|\?', line):
        return
    for match in re.finditer(r'(?<![<>=!-])(<=|>=|<|>)(?![<>=])', line):
        op = match.group(1)
        before = line[:match.start()]
        if op in ('<', '>') and re.search(r'(template\s*|static_cast|reinterpret_cast|Vec|'
                                          r'acc_t|from_acc|load_vec|store_vec|ChannelSlice|'
                                          r'<[A-Za-z_, ]*)$', before):
            continue  # a template argument list, not a comparison
        swapped = {'<': '<=', '<=': '<', '>': '>=', '>=': '>'}[op]
        yield before + swapped + line[match.end():]


OPERATORS = {
    'drop_syncthreads': _drop_syncthreads,
    'shuffle_offset': _subst(r'(__shfl\w*_sync\([^,]+,[^,]+,\s*)([^,()]+)\)', r'\1\2 + 1)'),
    'bound_off_by_one': _guard,
    'drop_alignment': _subst(r'aligned16\([^()]*\)', 'true'),
    'narrow_index': _subst(r'\((i64|u64)\)', lambda m: '(int)' if m.group(1) == 'i64' else '(unsigned)'),
    'acc_in_storage_type': _subst(r'\b(\w+)\s*(\+|-)=\s*([^;]+);',
                                  r'\1 = to_float(from_acc<T>(\1 \2 (\3)));'),
    'atomic_to_plain': _subst(r'atomicAdd\(([^,]+),\s*(.+)\);', r'*(\1) += \2;'),
}


def mutants(files, operators):
    found = []
    for path in files:
        lines = (CUDA / path).read_text().split('\n')
        for number, line in enumerate(lines, 1):
            code = line.split('//')[0]
            if not code.strip() or code.lstrip().startswith(('#include', '*')):
                continue
            for operator in operators:
                for occurrence, new in enumerate(OPERATORS[operator](code)):
                    if new != code:
                        found.append(Mutant(path, operator, number, occurrence, line,
                                            new + line[len(code):]))
    return found


def _pytest(mutant, scratch, sanitize, timeout):
    tests = TESTS.get(mutant.path, _LAYER_TESTS)
    # a test stuck in a loop ends its process after 60 s (pytest-timeout's thread method: the
    # loop is in C, where no Python signal handler would run); a sanitizer's build and run
    # may take longer, and its tests already ended in the plain run
    cmd = [sys.executable, '-m', 'pytest', '-x', '-q', '-p', 'no:cacheprovider', '-p', 'no:xdist',
           '--capture=sys', '--timeout=%d' % (600 if sanitize else 60),
           '--timeout-method=thread'] + tests
    select = SELECT.get(mutant.path)
    if sanitize:  # the order of threads does not matter to what a sanitizer sees
        racy = RACY if sanitize[0] == 'tsan' else 'not reverse and not random'
        select = '(%s) and (%s)' % (select, racy) if select else racy
    if select:
        cmd += ['-k', select]
    path = [str(ROOT)] + os.environ.get('PYTHONPATH', '').split(os.pathsep)
    env = dict(os.environ, CAFFE_SYNCBN_EMU_CUDA_DIR=str(scratch), PYTHONPATH=os.pathsep.join(path))
    env.pop('CAFFE_SYNCBN_EMU_SANITIZE', None)
    if sanitize:
        runtime = subprocess.run(['g++', '-print-file-name=lib%s.so' % sanitize[0]],
                                 capture_output=True, text=True).stdout.strip()
        env.update(CAFFE_SYNCBN_EMU_SANITIZE=sanitize[1], LD_PRELOAD=runtime,
                   ASAN_OPTIONS='detect_leaks=0')
    try:
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired:
        if sanitize:  # slow, not stuck: the plain run of the same tests finished
            return 'survived', '%s run timed out' % sanitize[0].upper()
        return 'killed', 'hangs (timed out after %d s)' % timeout
    out = result.stdout + result.stderr
    if '+++ Timeout +++' in out:
        if sanitize:  # slow, not stuck: the plain run of the same tests finished
            return 'survived', '%s run timed out' % sanitize[0].upper()
        return 'killed', 'hangs (a test ran past 60 s)'
    if 'emulation build of' in out and 'failed' in out and result.returncode != 0:
        return 'stillborn', 'g++ rejects it'
    if result.returncode == 0:
        return 'survived', ''
    summary = re.search(r'SUMMARY: (\w+Sanitizer: [^\n]*)', out)
    failed = re.search(r'^FAILED (\S+)', out, re.M)
    error = re.search(r'^E\s+(\S[^\n]*)', out, re.M)
    detail = summary.group(1) if summary else (failed.group(1) if failed else '')
    if error and not summary:
        detail += ' (%s)' % error.group(1)[:100]
    return 'killed', detail or 'exit status %d' % result.returncode


def run(mutant, timeout):
    start = time.time()
    scratch = Path(tempfile.mkdtemp(prefix='mutant_'))
    try:
        for source in CUDA.iterdir():
            shutil.copy(source, scratch / source.name)
        lines = (CUDA / mutant.path).read_text().split('\n')
        assert lines[mutant.line_number - 1] == mutant.before
        lines[mutant.line_number - 1] = mutant.after
        (scratch / mutant.path).write_text('\n'.join(lines))
        for sanitize in (None,) + SANITIZERS.get(mutant.operator, ()):
            mutant.status, mutant.detail = _pytest(mutant, scratch, sanitize, timeout)
            if sanitize and mutant.status == 'killed':
                mutant.detail = '%s only: %s' % (sanitize[0].upper(), mutant.detail)
            if mutant.status != 'survived':
                break
        if mutant.status == 'survived' and mutant.key in EQUIVALENT:
            mutant.status, mutant.detail = 'equivalent', EQUIVALENT[mutant.key]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    mutant.seconds = time.time() - start
    return mutant


def _survivors(log):
    """The keys of the mutants a previous run printed as survived or equivalent: a status
    line 'survived path:line operator#k ...' followed by the original line."""
    keys = set()
    lines = log.split('\n')
    for status, before in zip(lines, lines[1:]):
        match = re.match(r'(survived|equivalent)\s+(\S+):\d+ (\w+)#(\d+)', status)
        if match:
            keys.add((match.group(2), match.group(3), before.strip(), int(match.group(4))))
    return keys


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--file', action='append', help='only this cuda/ file (repeatable)')
    parser.add_argument('--operator', action='append', choices=sorted(OPERATORS))
    parser.add_argument('--list', action='store_true', help='list the mutants and stop')
    parser.add_argument('--jobs', '-j', type=int, default=2)
    parser.add_argument('--timeout', type=int, default=300, help='seconds per test run')
    parser.add_argument('--markdown', action='store_true', help='print the survivors as a table')
    parser.add_argument('--rerun', metavar='LOG',
                        help="only the mutants a previous run's output lists as survivors")
    args = parser.parse_args()
    files = args.file or sorted(p.name for p in CUDA.iterdir() if p.suffix in ('.cu', '.cuh'))
    todo = mutants(files, args.operator or sorted(OPERATORS))
    if args.rerun:
        todo = [m for m in todo if m.key in _survivors(Path(args.rerun).read_text())]
    if args.list:
        for m in todo:
            print('%-40s %s\n%40s %s' % (m.name, m.before.strip(), '->', m.after.strip()))
        print('%d mutants' % len(todo))
        return 0
    done = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for m in pool.map(lambda m: run(m, args.timeout), todo):
            done.append(m)
            print('%-10s %-40s %5.1fs %s' % (m.status, m.name, m.seconds, m.detail), flush=True)
            if m.status in ('survived', 'equivalent'):
                print('           %s\n        -> %s' % (m.before.strip(), m.after.strip()), flush=True)
    counts = {s: sum(m.status == s for m in done) for s in ('killed', 'survived', 'equivalent',
                                                            'stillborn')}
    scored = counts['killed'] + counts['survived']
    print('\n%d mutants: %d killed, %d survived, %d equivalent, %d stillborn; score %.1f%% '
          '(killed / non-equivalent)' % (len(done), counts['killed'], counts['survived'],
                                         counts['equivalent'], counts['stillborn'],
                                         100.0 * counts['killed'] / max(scored, 1)))
    if args.markdown:
        print('\n| mutant | change | status | why |\n|---|---|---|---|')
        for m in done:
            if m.status in ('survived', 'equivalent'):
                print('| `%s:%d` %s | `%s` → `%s` | %s | %s |' % (
                    m.path, m.line_number, m.operator, m.before.strip(), m.after.strip(),
                    m.status, m.detail or 'not yet explained'))
    return 1 if counts['survived'] else 0


if __name__ == '__main__':
    sys.exit(main())
