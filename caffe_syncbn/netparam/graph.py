"""Rewrites of a NetParameter before layers are built: phase/level/stage filtering and
the Split layers Caffe inserts where one blob feeds several consumers."""
from .. import caffe_pb2
from ..errors import layer_error


def state_meets_rule(state, rule):
    if rule.HasField('phase') and rule.phase != state.phase:
        return False
    if rule.HasField('min_level') and state.level < rule.min_level:
        return False
    if rule.HasField('max_level') and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    if any(s not in stages for s in rule.stage):
        return False
    if any(s in stages for s in rule.not_stage):
        return False
    return True


def layer_included(layer, state):
    if layer.include and layer.exclude:
        raise layer_error(layer, 'has both include and exclude rules; use one kind')
    if layer.include:
        return any(state_meets_rule(state, r) for r in layer.include)
    return not any(state_meets_rule(state, r) for r in layer.exclude)


def net_state(net_param, phase, level=0, stages=()):
    """The state a net is built in, as Caffe makes it: the prototxt's own ``state`` with
    the phase and level given, and ``stages`` added to its stages."""
    state = caffe_pb2.NetState()
    state.CopyFrom(net_param.state)
    state.phase, state.level = phase, level
    state.stage.extend(stages)
    return state


def filter_net(net_param, state):
    """A copy of ``net_param`` with only the layers that ``state`` includes."""
    filtered = caffe_pb2.NetParameter()
    filtered.CopyFrom(net_param)
    del filtered.layer[:]
    filtered.state.CopyFrom(state)
    for layer in net_param.layer:
        if layer_included(layer, state):
            filtered.layer.add().CopyFrom(layer)
    return filtered


def automatic_top(net_param, layer):
    """The top Caffe gives a loss layer that names none (AutoTopBlobs), so that its loss
    counts (DeepLab's training nets leave them out): named as the layer where no blob of
    ``net_param`` is, and, unlike Caffe's anonymous one, an output of the net."""
    taken = {top for other in net_param.layer for top in other.top}
    return layer.name if layer.name not in taken else layer.name + ' (automatic)'


def split_blob_name(layer_name, blob_name, top_index, k):
    return '%s_%s_%d_split_%d' % (blob_name, layer_name, top_index, k)


def insert_splits(net_param):
    """A copy of ``net_param`` where every blob with several consumers goes through a Split.

    A top with an explicit non-zero loss_weight counts as one more consumer; the
    Split then carries that loss weight on its first top, as in Caffe.
    """
    last_producer = {}            # blob name -> (layer index, top index) of its latest producer
    consumers = {}                # (layer index, top index) -> number of uses
    source_of_bottom = {}         # (layer index, bottom index) -> (layer index, top index)
    loss_weight = {}
    layers = net_param.layer
    for i, layer in enumerate(layers):
        for j, name in enumerate(layer.bottom):
            if name not in last_producer:
                continue          # the Net reports the missing bottom with the layer's name
            source = last_producer[name]
            source_of_bottom[(i, j)] = source
            consumers[source] = consumers.get(source, 0) + 1
        for j, name in enumerate(layer.top):
            last_producer[name] = (i, j)
        for j in range(min(len(layer.loss_weight), len(layer.top))):
            source = last_producer[layer.top[j]]
            loss_weight[source] = layer.loss_weight[j]
            if layer.loss_weight[j]:
                consumers[source] = consumers.get(source, 0) + 1

    result = caffe_pb2.NetParameter()
    result.CopyFrom(net_param)
    del result.layer[:]
    next_split = {}
    for i, layer in enumerate(layers):
        copy = result.layer.add()
        copy.CopyFrom(layer)
        for j, name in enumerate(layer.bottom):
            source = source_of_bottom.get((i, j))
            if source is not None and consumers[source] > 1:
                k = next_split.get(source, 0)
                next_split[source] = k + 1
                copy.bottom[j] = split_blob_name(layers[source[0]].name, name, source[1], k)
        for j, name in enumerate(layer.top):
            count = consumers.get((i, j), 0)
            if count <= 1:
                continue
            split = result.layer.add()
            split.name = '%s_%s_%d_split' % (name, layer.name, j)
            split.type = 'Split'
            split.bottom.append(name)
            weight = loss_weight.get((i, j), 0)
            for k in range(count):
                split.top.append(split_blob_name(layer.name, name, j, k))
                if weight:
                    split.loss_weight.append(weight if k == 0 else 0)
            if weight:
                del copy.loss_weight[:]
                next_split[(i, j)] = 1   # split top 0 carries the loss
    return result


def shared_param_owners(layers):
    """{(layer name, blob index): (owner's name, blob index)} for the params of
    ``layers`` (LayerParameters) that share one named by an earlier layer (ParamSpec.name)."""
    owners, shared = {}, {}
    for layer in layers:
        for j, spec in enumerate(layer.param):
            if spec.name:
                owner = owners.setdefault(spec.name, (layer.name, j))
                if owner != (layer.name, j):
                    shared[(layer.name, j)] = owner
    return shared
