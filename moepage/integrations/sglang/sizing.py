"""``--paged-experts-num-resident auto``: K from the GPU memory budget and the checkpoint's safetensors headers
(``moepage.planning.sizing``: no tensor data read). The budget is GPU memory x ``mem_fraction_static``; less a KV
reserve (``MOEPAGE_KV_RESERVE_FRACTION`` of it, default 0.25) and the non-expert weights, it buys slots, each one
expert in every MoE layer (``CheckpointSize.slots_fitting``), K the smaller of those and E. Below top_k: a
``ConfigError`` with the numbers. Under TP / EP every rank sizes its own K from its own GPU (``RankShare``): its
share of the non-expert weights (``/ tp_size``: SGLang shards attention and the vocabulary; the small replicated rest
is not told apart), of each expert (``/ moe_tp_size``) and its ``E / ep_size`` local experts."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from ...config import KV_RESERVE_FRACTION, env
from ...errors import ConfigError
from ...planning.sizing import CheckpointSize, checkpoint_size

logger = logging.getLogger("moepage.sglang")


@dataclass(frozen=True)
class RankShare:
    """What one rank holds of the checkpoint: 1 / ``tp_size`` of the non-expert weights, 1 / ``moe_tp_size`` of each
    expert it holds (its ``E / ep_size`` local experts are the ``num_experts`` that sizing is given)."""

    tp_size: int = 1
    moe_tp_size: int = 1
    ep_size: int = 1

    def of(self, size: CheckpointSize) -> CheckpointSize:
        """The part of ``size`` this rank holds (rounded up)."""
        return replace(size, dense_bytes=-(-size.dense_bytes // self.tp_size),
                       expert_bytes=[-(-b // self.moe_tp_size) for b in size.expert_bytes])

    def describe(self) -> str:
        return "" if self == RankShare() else (f" (this rank's share: tp_size {self.tp_size}, moe_tp_size "
                                               f"{self.moe_tp_size}, ep_size {self.ep_size})")


def rank_share(layer) -> RankShare:
    """The share of the rank building ``layer`` (SGLang's published widths, and the layer's own)."""
    from .compat import parallel

    return RankShare(int(getattr(parallel(), "tp_size", 1) or 1), int(layer.moe_tp_size or 1),
                     int(layer.moe_ep_size or 1))


def choose_resident(
    size: CheckpointSize,
    num_experts: int,
    top_k: int,
    gpu_bytes: int,
    mem_fraction_static: float,
    kv_reserve_fraction: float = KV_RESERVE_FRACTION,
    share: RankShare = RankShare(),
) -> tuple[int, dict]:
    """K of this rank's ``num_experts`` and the figures it came from (logged by ``auto_resident``)."""
    budget = int(gpu_bytes * mem_fraction_static)
    kv = int(budget * kv_reserve_fraction)
    rank = share.of(size)
    k = rank.slots_fitting(budget, kv)  # the planning rule; E and top_k here are the layer's, not the config's
    figures = dict(budget=budget, kv_reserve=kv, non_expert=rank.dense_bytes, per_slot=rank.slot_bytes,
                   moe_layers=size.num_layers, fits=k)
    need = min(top_k, num_experts)  # under EP a token routes at most num_experts of its top_k here
    if k < need:
        raise ConfigError(
            f"--paged-experts-num-resident auto: the GPU budget {budget} B (total {gpu_bytes} B x "
            f"mem_fraction_static {mem_fraction_static}) minus non-expert weights {rank.dense_bytes} B "
            f"and KV reserve {kv} B leaves room for {k} experts per layer "
            f"({rank.slot_bytes} B each across {size.num_layers} MoE layers){share.describe()}; "
            f"{f'top_k={top_k}' if need == top_k else f'all {need} local experts'} are needed. "
            "Raise --mem-fraction-static, lower MOEPAGE_KV_RESERVE_FRACTION or pass an integer K"
        )
    return min(k, num_experts), figures


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


def auto_resident(num_experts: int, top_k: int, device, share: RankShare = RankShare()) -> int:
    """K for ``auto`` on this rank (computed once while its paged layers live, logged)."""
    import torch

    from ..session import CHOSEN
    from .compat import runtime

    if torch.device(device).type != "cuda":
        raise ConfigError("--paged-experts-num-resident auto needs a CUDA device to size against; pass an integer")
    model_path = runtime().get_model().model_path
    key = (model_path, num_experts, top_k, share)
    if key in CHOSEN:
        return CHOSEN[key]
    gpu = torch.cuda.get_device_properties(torch.device(device)).total_memory
    fraction = _mem_fraction_static()
    reserve = env("MOEPAGE_KV_RESERVE_FRACTION")
    k, fig = choose_resident(checkpoint_size(model_path), num_experts, top_k, gpu, fraction, reserve, share)
    logger.info(
        "moepage: --paged-experts-num-resident auto chose K=%d of %d experts: budget %d B "
        "(GPU %d B x mem_fraction_static %.3f), KV reserve %d B, non-expert weights %d B, "
        "%d B per slot (one expert in each of %d MoE layers)%s",
        k, num_experts, fig["budget"], gpu, fraction, fig["kv_reserve"], fig["non_expert"],
        fig["per_slot"], fig["moe_layers"], share.describe(),
    )
    CHOSEN[key] = k
    return k
