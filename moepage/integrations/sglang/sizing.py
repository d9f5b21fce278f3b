"""``--paged-experts-num-resident auto`` on SGLang: where SGLang keeps the checkpoint, the memory fraction
(``--mem-fraction-static``) and each rank's share; the rule is ``moepage.integrations.auto``."""

from __future__ import annotations

import logging

from ...errors import ConfigError
from ..auto import RankShare, resident

__all__ = ["auto_resident", "rank_share"]

logger = logging.getLogger("moepage.sglang")


def rank_share(layer) -> RankShare:
    """The share of the rank building ``layer`` (SGLang's published widths, and the layer's own)."""
    from .compat import parallel

    return RankShare(int(getattr(parallel(), "tp_size", 1) or 1), int(layer.moe_tp_size or 1),
                     int(layer.moe_ep_size or 1), int(layer.moe_tp_rank or 0), int(layer.moe_ep_rank or 0))


def _mem_fraction_static() -> float:
    from .compat import runtime

    rc = runtime()
    for getter in ("get_memory", "get_schedule"):
        try:
            value = getattr(getattr(rc, getter)(), "mem_fraction_static", None)
        except (ValueError, AttributeError):
            value = None
        if value:
            return float(value)
    value = getattr(rc.get_server_args(), "mem_fraction_static", None)
    return float(value) if value else 0.85


def auto_resident(num_experts: int, top_k: int, device, share: RankShare | None = None) -> int:
    """K for ``auto`` on this rank (computed once while its paged layers live, logged)."""
    import torch

    from .compat import runtime

    if torch.device(device).type != "cuda":
        raise ConfigError("--paged-experts-num-resident auto needs a CUDA device to size against; pass an integer")
    gpu = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return resident(runtime().get_model().model_path, num_experts, top_k, gpu, _mem_fraction_static(),
                    share or RankShare(),
                    fraction_flag="--mem-fraction-static", logger=logger)
