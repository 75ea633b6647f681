"""Devices by name: ``parse_devices('cpu:4')`` (the devices argument of get_solver), and
the lines that name them in the log."""
import os

from ..backend import Device, gpu_count
from ..errors import CaffeError


def parse_devices(devices):
    """'cpu:4', 'cpu:0,1', ['cpu:0', 'cpu:1'], 'gpu:0,1', 'gpu:all', 'gpu:0,0' -> [Device]."""
    if isinstance(devices, str):
        kind, _, rest = devices.partition(':')
        kind = kind.strip().lower()
        if kind not in ('cpu', 'gpu'):
            raise CaffeError("devices %r: expected 'cpu:N', 'cpu:i,j', 'gpu:i,j' or 'gpu:all'" % devices)
        if kind == 'cpu':
            if rest.isdigit() and ',' not in rest:
                count = int(rest)
                return [Device('cpu', i) for i in range(count)] if count > 0 else _bad(devices)
            return [Device('cpu', _index(i, devices)) for i in rest.split(',')] if rest \
                else [Device('cpu', 0)]
        count = gpu_count()
        if count == 0:
            raise CaffeError('devices %r: no GPU is available here (CuPy missing or no CUDA '
                             'device); use CPU devices instead, e.g. cpu:4' % devices)
        if rest in ('all', ''):
            return [Device('gpu', i) for i in range(count)]
        ids = [_index(i, devices) for i in rest.split(',')]
        if max(ids) >= count:
            raise CaffeError('devices %r: GPU %d does not exist (%d visible)' % (devices, max(ids), count))
        return [Device('gpu', i) for i in ids]
    parsed = []
    for item in devices:             # in a list, 'cpu:4' is the device cpu:4, not four devices
        item = str(item)
        parsed.extend(parse_devices(item) if ',' in item or item.endswith(':all') else [_one(item)])
    if not parsed:
        _bad(devices)
    return parsed


def describe_devices(devices, replication=None):
    """Lines that name the devices of a run, in Caffe's words where Caffe has some (and,
    in a job of several processes, this process's place in it)."""
    ids = [index for kind, index in devices if kind == 'gpu']
    if not ids:
        if len(devices) == 1:
            lines = ['Use CPU.']
        else:
            lines = ['Using %d virtual CPU devices (threads) on %d CPU cores'
                     % (len(devices), os.cpu_count() or 1)]
    else:
        lines = ['Using GPUs %s' % ', '.join(map(str, ids))] + \
            ['GPU %d: %s' % (i, gpu_name(i)) for i in sorted(set(ids))]
    if replication is not None and replication.processes > 1:
        lines.append('Process %d of %d (MPI): replicas %d to %d of %d'
                     % (replication.process, replication.processes, replication.first,
                        replication.first + len(devices) - 1, replication.total))
    return lines


def gpu_name(index):
    return Device('gpu', index).runtime.name(index)


def _index(text, devices):
    if not text.strip().isdigit():
        raise CaffeError('devices %r: %r is not a device number' % (devices, text))
    return int(text)


def _one(item):
    kind, _, index = str(item).partition(':')
    if kind not in ('cpu', 'gpu') or not index.isdigit():
        raise CaffeError("device %r: expected 'cpu:i' or 'gpu:i'" % (item,))
    return Device(kind, int(index))


def _bad(devices):
    raise CaffeError('devices %r: need at least one device' % devices)
