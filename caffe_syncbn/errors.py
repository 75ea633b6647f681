"""Errors a user can act on: they name the file, the layer and the shapes involved."""


class CaffeError(Exception):
    """A problem with the user's net, weights or data (not a bug in this package)."""


def layer_error(param, message):
    """A CaffeError that names the layer (name and type) it came from."""
    return CaffeError("layer '%s' (type %s): %s" % (param.name, param.type, message))
