"""The kernel cache compiles each module once per device, also when the replicas' threads all
ask for it at once on a cold cache (a stand-in CuPy counts the compilations)."""
import sys
import threading
import time
import types

from caffe_syncbn.backend import cuda_kernels


class FakeModule:
    compiled = []

    def __init__(self, code, options):
        time.sleep(0.05)                  # compiling takes a while: the threads overlap
        FakeModule.compiled.append(code)

    def get_function(self, name):
        return ('kernel', name)


class FakeDevice:
    def __init__(self, device_id=0):
        self.id = device_id

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_four_threads_compile_a_module_once(monkeypatch):
    fake = types.SimpleNamespace(RawModule=FakeModule,
                                 cuda=types.SimpleNamespace(Device=FakeDevice))
    monkeypatch.setitem(sys.modules, 'cupy', fake)
    monkeypatch.setattr(cuda_kernels, '_compiled', {})
    FakeModule.compiled = []
    start = threading.Barrier(4)
    results = []

    def ask():
        start.wait()
        results.append(cuda_kernels.kernel('norm', 'syncbn_normalize_f32'))
        results.append(cuda_kernels.kernel('norm', 'syncbn_backward_dx_f32'))
    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(FakeModule.compiled) == 1
    assert sorted(set(results)) == [('kernel', 'syncbn_backward_dx_f32'),
                                    ('kernel', 'syncbn_normalize_f32')]
    cuda_kernels._function('norm', 'syncbn_normalize_f32', 1)      # another device
    assert len(FakeModule.compiled) == 2
