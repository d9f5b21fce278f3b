"""The stacked-experts ``torch.nn`` adapter: ``wrap`` a module or model, and the paged layers it
attaches (``find``: which modules and their plans; ``layer``: the paged module's step; ``hooks``:
``state_dict``, ``load_state_dict`` and grad mode on a paged module)."""

from .find import find_experts
from .layer import PagedLayer, paged_layer
from .wrap import host_bytes, paged_layers, stats, unwrap, wrap

__all__ = ["PagedLayer", "find_experts", "host_bytes", "paged_layer", "paged_layers", "stats", "unwrap", "wrap"]
