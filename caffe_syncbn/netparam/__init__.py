"""NetParameter and SolverParameter as messages: reading prototxt, upgrading old formats,
phase and stage rules, Split insertion, and data layers swapped for Input layers. Nothing
here knows a weight or builds a layer."""
from .graph import filter_net, insert_splits, net_state
from .inputs import swap_data_layers_for_inputs
from .prototxt import read_prototxt
from .upgrade import load_net_param, upgrade_net_param

__all__ = ['filter_net', 'insert_splits', 'load_net_param', 'net_state', 'read_prototxt',
           'swap_data_layers_for_inputs', 'upgrade_net_param']
