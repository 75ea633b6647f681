"""Caffe's weight fillers (FillerParameter), drawn on the host from the seeded RNG."""
import math

import numpy as np

from .errors import CaffeError, quote

_rng = {'state': np.random.RandomState()}


def set_random_seed(seed):
    """Seed the RNG that fillers (and anything else seeded by Caffe's seed) draw from."""
    _rng['state'] = np.random.RandomState(int(seed) & 0xFFFFFFFF)


def rng():
    return _rng['state']


def _fans(shape):
    count = int(np.prod(shape))
    fan_in = count // shape[0] if shape and shape[0] else count
    fan_out = count // shape[1] if len(shape) > 1 and shape[1] else count
    return fan_in, fan_out


def _variance_scale(param, shape):
    fan_in, fan_out = _fans(shape)
    norm = param.variance_norm
    if norm == param.AVERAGE:
        return (fan_in + fan_out) / 2.0
    if norm == param.FAN_OUT:
        return float(fan_out)
    return float(fan_in)


def _bilinear(shape):
    if len(shape) != 4 or shape[2] != shape[3]:
        raise CaffeError('bilinear filler needs a 4-D blob with square kernels, got %s' % (shape,))
    k = shape[3]
    f = np.ceil(k / 2.0)
    c = (2 * f - 1 - f % 2) / (2.0 * f)
    ramp = 1 - np.abs(np.arange(k) / f - c)
    return np.broadcast_to(np.outer(ramp, ramp), shape)


def check_filler(param):
    """Reject the FillerParameters that would draw NaN or infinite values, or none at all."""
    kind = param.type
    fields = {'constant': ('value',), 'uniform': ('min', 'max'), 'gaussian': ('mean', 'std')}
    for field in fields.get(kind, ()):
        if not math.isfinite(getattr(param, field)):
            raise CaffeError("filler %s: %s must be finite, got %g"
                             % (quote(kind), field, getattr(param, field)))
    if kind == 'uniform' and not (param.min <= param.max and math.isfinite(param.max - param.min)):
        raise CaffeError("filler 'uniform': needs min <= max, a finite range, got [%g, %g]"
                         % (param.min, param.max))
    if kind == 'gaussian' and param.std < 0:
        raise CaffeError("filler 'gaussian': std must be >= 0, got %g" % param.std)


#: fill() draws at most this many float64 values at a time
FILL_CHUNK = 1 << 20


def _independent_draws(param, shape):
    """``draw(n)``: the next n values (float64) for fillers whose values are drawn one
    after another, independently of where they go; None for the other fillers."""
    r = rng()
    kind = param.type
    if kind == 'constant':
        return lambda n: np.full(n, param.value)
    if kind == 'uniform':
        return lambda n: r.uniform(param.min, param.max, n)
    if kind == 'gaussian' and param.sparse < 0:
        return lambda n: r.normal(param.mean, param.std, n)
    if kind == 'xavier':
        bound = np.sqrt(3.0 / _variance_scale(param, shape))
        return lambda n: r.uniform(-bound, bound, n)
    if kind == 'msra':
        return lambda n: r.normal(0.0, np.sqrt(2.0 / _variance_scale(param, shape)), n)
    return None


def filled_array(param, shape):
    """A float64 host array of ``shape`` drawn as ``param`` (a FillerParameter) says."""
    shape = tuple(int(s) for s in shape)
    check_filler(param)
    if 0 in shape:
        return np.zeros(shape)
    draw = _independent_draws(param, shape)
    if draw is not None:
        return draw(int(np.prod(shape))).reshape(shape)
    r = rng()
    kind = param.type
    if kind == 'gaussian':          # sparse: a mask drawn after all the values
        if len(shape) < 2:
            raise CaffeError('gaussian filler with sparse needs a blob of >= 2 axes')
        values = r.normal(param.mean, param.std, shape)
        return values * r.binomial(1, min(1.0, param.sparse / float(shape[0])), shape)
    if kind == 'positive_unitball':
        values = r.uniform(0, 1, shape).reshape(shape[0] if shape else 1, -1)
        return (values / values.sum(axis=1, keepdims=True)).reshape(shape)
    if kind == 'bilinear':
        return _bilinear(shape).copy()
    raise CaffeError('unknown filler type %s (known: constant, uniform, gaussian, '
                     'positive_unitball, xavier, msra, bilinear)' % quote(kind))


def fill(param, blob):
    """Fill ``blob.data`` in place, FILL_CHUNK values at a time where the values are
    independent draws (the same values as one draw), so that no float64 copy of a large
    blob is made."""
    check_filler(param)
    draw = _independent_draws(param, blob.shape)
    if draw is None:
        blob.data[...] = blob.xp.asarray(filled_array(param, blob.shape).astype(blob.dtype))
        return
    flat = blob.data.reshape(-1)
    for start in range(0, flat.size, FILL_CHUNK):
        values = draw(min(FILL_CHUNK, flat.size - start)).astype(blob.dtype)
        flat[start:start + values.size] = blob.xp.asarray(values)
