"""What moepage's engine plugins share of their options (the table: ``flags``): a split file's K for one layer of a
serving process (layers are built one at a time, in order), and the rules a disk tier's options follow."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from ..backends import layouts
from ..backends.disk import identities
from ..config import SGLANG, host_budget, split_k
from ..errors import ConfigError
from ..planning.sizing import checkpoint_size, safetensors_files
from ..planning.tiers import folder_problem, warm_experts
from ..residency import k_problem
from .auto import RankShare
from .flags import OPTIONS
from .session import DiskTier

logger = logging.getLogger("moepage")

SPLIT_WHERE = OPTIONS["split"].where(SGLANG)  # the same variable under vLLM


@functools.lru_cache(maxsize=8)
def _split(path: str, k: int, *version) -> dict:
    """The split file's ``{layer: K}`` for a total of ``k`` per layer, read once per model (a
    re-split runs the budget allocation), again when the file changes (``version``)."""
    from ..planning.budgets import load_split

    return load_split(path, budget=k * len(load_split(path)))


def split_resident(path: str, k: int, index: int, name: str, num_experts: int, top_k: int) -> int:
    """This layer's K from a split file: the i-th MoE layer's, after the file is re-split to a
    total of ``k`` per layer when its own total differs."""
    where = f"{SPLIT_WHERE} {path!r}"
    try:
        stat = os.stat(path)
        layers = _split(path, k, stat.st_mtime_ns, stat.st_size)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    chosen = split_k(layers, index, name)
    if chosen is None:
        raise ConfigError(f"{where}: no K for MoE layer {index} ({name}); the file has {len(layers)} layers")
    if why := k_problem(chosen, num_experts, top_k, "K"):
        raise ConfigError(f"{where}: layer {index} ({name}): {why}")
    logger.info("moepage: layer %s (MoE layer %d) keeps K=%d from the split %s", name, index, chosen, path)
    return chosen


HOST_BUDGET, SPILL_DIR, HOST_WARM = (OPTIONS[key].flag for key in ("host_budget", "spill_dir", "host_warm"))


def tier_problems(budget: object, spill: object, warm: object = None, spill_name: str = SPILL_DIR) -> list[str]:
    """What is wrong with a disk tier's options as an engine plugin was given them (the engine adds its own graph
    rule): both or neither, a readable budget (host rows or a byte size), a warm trace only with it, a spill folder
    that can be one (``folder_problem``, as ``wrap`` checks it; ``spill_name``: the flag or variable it came by)."""
    if budget is None and warm is not None:
        return [f"{HOST_WARM} {warm} is for {HOST_BUDGET} (it says which experts the host tier starts with); pass "
                "the budget or drop it"]
    if budget is None and spill is None:
        return []
    if budget is None:
        return [f"{SPILL_DIR} is for {HOST_BUDGET} (experts kept on disk); pass both or neither"]
    out = []
    if spill is None:
        out.append(f"{HOST_BUDGET} {budget} keeps experts on disk: pass {SPILL_DIR} DIR (where moepage keeps their "
                   "rows)")
    try:
        host_budget(str(budget))
    except ValueError as exc:
        out.append(f"{HOST_BUDGET} {budget!r}: {exc}")
    if spill is not None and (why := folder_problem(spill, 0)):  # the rows' bytes: known once the layers are built
        out.append(f"{spill_name} {spill!r}: {why}")
    return out


def disk_tier(budget: object, spill: object, policy: str, checkpoint: Callable[[], tuple[str | None, RankShare]],
              engine: str) -> DiskTier | None:
    """The disk tier an engine's options ask for (None without both, or with a budget ``tier_problems`` refuses), its
    H still to settle for each layer (``DiskTier.settled``): the budget's rows, or its bytes over one expert row as the
    layer holds it in every MoE layer of this rank's share of the checkpoint (``checkpoint()``: its folder, None where
    it is not on this machine, and the share). Its ``source`` names the checkpoint's files as they are and ``engine``:
    a layer's rows laid out from the same source are reused by the next start (each rank its own)."""
    if budget is None or spill is None:
        return None
    try:
        value = host_budget(str(budget))
    except ValueError:
        return None
    path, share = checkpoint()
    layers = 1
    if isinstance(value, str):
        if path is None:
            raise ConfigError(f"{HOST_BUDGET} {value}: a byte budget is shared by the checkpoint's MoE layers, counted "
                              "from its safetensors headers, which are not on this machine; pass host rows")
        layers = _moe_layers(path)
    files = _files(path)
    return DiskTier(os.path.expanduser(str(spill)), 0, policy, _source(files, share, engine), tuple(map(str, files)),
                    budget=value, where=f"{HOST_BUDGET} {value}", num_layers=layers)


def warmed(tier: DiskTier | None, trace: object, index: int, name: str, num_experts: int) -> DiskTier | None:
    """``tier`` with the experts its host tier starts with: those MoE layer ``index`` routes to most in ``trace``
    (``--paged-experts-host-warm``), the most used first (the store reads the first H); unchanged without a trace."""
    if tier is None or trace is None:
        return tier
    try:
        experts = warm_experts(trace, index, name, num_experts, num_experts)
    except ValueError as exc:
        raise ConfigError(f"moepage: {HOST_WARM} {trace!r}: {exc}") from None
    return replace(tier, warm=tuple(experts))


def _files(path: str | None) -> list[Path]:
    """The checkpoint's safetensors files where it is a folder on this machine, else none."""
    if not path or not os.path.isdir(path):
        return []
    try:
        return safetensors_files(Path(path))
    except ConfigError:
        return []


def _source(files: list[Path], share: RankShare, engine: str) -> str | None:
    """What a rank's rows are made from, as JSON (``layouts.source_of``): the checkpoint's files as they are now, and
    under TP / EP the rank's share and place (each rank keeps its own layout)."""
    if not files:
        return None
    rank = None if share.single else asdict(share)
    return json.dumps(layouts.source_of(files=identities(files), engine=engine, rank=rank), sort_keys=True)


@functools.lru_cache(maxsize=8)
def _moe_layers(path: str) -> int:
    """The checkpoint's MoE layers (read once per checkpoint, not once per layer): every rank builds each of them."""
    return checkpoint_size(path).num_layers
