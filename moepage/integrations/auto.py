"""K = ``auto`` for the engine plugins: K from the GPU memory budget and the checkpoint's safetensors headers
(``moepage.planning.sizing``: no tensor data read). The budget is GPU memory x the engine's memory fraction
(SGLang's ``--mem-fraction-static``, vLLM's ``--gpu-memory-utilization``); less a KV reserve
(``MOEPAGE_KV_RESERVE_FRACTION`` of it, default 0.25) and the non-expert weights, it buys slots, each one expert in
every MoE layer (``CheckpointSize.slots_fitting``), K the smaller of those and E. Below top_k: a ``ConfigError`` with
the numbers. Under TP / EP every rank sizes its own K from its own GPU (``RankShare``). The engines say where the
checkpoint, the GPU and the fraction are; this module owns the rule."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from ..config import KV_RESERVE_FRACTION, env
from ..errors import ConfigError
from ..planning.sizing import CheckpointSize, checkpoint_size
from . import session
from .flags import OPTIONS

RESIDENT_FLAG = OPTIONS["num_resident"].flag


@dataclass(frozen=True)
class RankShare:
    """What one rank holds of the checkpoint: 1 / ``tp_size`` of the non-expert weights (the engines shard attention
    and the vocabulary; the small replicated rest is not told apart), 1 / ``moe_tp_size`` of each expert it holds (its
    ``E / ep_size`` local experts are the ``num_experts`` that sizing is given)."""

    tp_size: int = 1
    moe_tp_size: int = 1
    ep_size: int = 1
    moe_tp_rank: int = 0  # which shard of each expert, and which of the E / ep_size experts, this rank holds
    ep_rank: int = 0

    def of(self, size: CheckpointSize) -> CheckpointSize:
        """The part of ``size`` this rank holds (rounded up)."""
        return replace(size, dense_bytes=-(-size.dense_bytes // self.tp_size),
                       expert_bytes=[-(-b // self.moe_tp_size) for b in size.expert_bytes])

    def describe(self) -> str:
        return "" if self.single else (f" (this rank's share: tp_size {self.tp_size}, moe_tp_size "
                                       f"{self.moe_tp_size}, ep_size {self.ep_size})")

    @property
    def single(self) -> bool:
        """One rank holds the whole checkpoint."""
        return (self.tp_size, self.moe_tp_size, self.ep_size) == (1, 1, 1)


def choose_resident(
    size: CheckpointSize,
    num_experts: int,
    top_k: int,
    gpu_bytes: int,
    fraction: float,
    kv_reserve_fraction: float = KV_RESERVE_FRACTION,
    share: RankShare = RankShare(),
    *,
    fraction_flag: str = "--mem-fraction-static",
) -> tuple[int, dict]:
    """K of this rank's ``num_experts`` and the figures it came from; ``fraction_flag`` is the engine's flag for
    ``fraction`` (named in the error)."""
    budget = int(gpu_bytes * fraction)
    kv = int(budget * kv_reserve_fraction)
    rank = share.of(size)
    k = rank.slots_fitting(budget, kv)  # the planning rule; E and top_k here are the layer's, not the config's
    figures = dict(budget=budget, kv_reserve=kv, non_expert=rank.dense_bytes, per_slot=rank.slot_bytes,
                   moe_layers=size.num_layers, fits=k)
    need = min(top_k, num_experts)  # under EP a token routes at most num_experts of its top_k here
    if k < need:
        raise ConfigError(
            f"{RESIDENT_FLAG} auto: the GPU budget {budget} B (total {gpu_bytes} B x "
            f"{fraction_flag.lstrip('-').replace('-', '_')} {fraction}) minus non-expert weights {rank.dense_bytes} B "
            f"and KV reserve {kv} B leaves room for {k} experts per layer "
            f"({rank.slot_bytes} B each across {size.num_layers} MoE layers){share.describe()}; "
            f"{f'top_k={top_k}' if need == top_k else f'all {need} local experts'} are needed. "
            f"Raise {fraction_flag}, lower MOEPAGE_KV_RESERVE_FRACTION or pass an integer K"
        )
    return min(k, num_experts), figures


def resident(model_path: str, num_experts: int, top_k: int, gpu_bytes: int, fraction: float, share: RankShare,
             *, fraction_flag: str, logger: logging.Logger) -> int:
    """K for ``auto`` on this rank, chosen once per model, E, top_k and share while the engine's layers live, and
    logged on ``logger`` (the engine's)."""
    key = (model_path, num_experts, top_k, share)
    if key in session.CHOSEN:
        return session.CHOSEN[key]
    reserve = env("MOEPAGE_KV_RESERVE_FRACTION")
    k, fig = choose_resident(checkpoint_size(model_path), num_experts, top_k, gpu_bytes, fraction, reserve, share,
                             fraction_flag=fraction_flag)
    name = fraction_flag.lstrip("-").replace("-", "_")
    logger.info(
        "moepage: %s auto chose K=%d of %d experts: budget %d B (GPU %d B x %s %.3f), KV reserve %d B, "
        "non-expert weights %d B, %d B per slot (one expert in each of %d MoE layers)%s",
        RESIDENT_FLAG, k, num_experts, fig["budget"], gpu_bytes, name, fraction, fig["kv_reserve"],
        fig["non_expert"], fig["per_slot"], fig["moe_layers"], share.describe(),
    )
    session.CHOSEN[key] = k
    return k
