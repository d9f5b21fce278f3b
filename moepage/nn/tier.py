"""A disk tier's options for ``wrap`` and ``from_pretrained``: ``host_budget=``, ``spill_dir=`` and ``host_warm=``, or,
where an argument is not given, its ``MOEPAGE_*`` variable. Each value is checked and named as the user gave it (the
argument or the variable) before anything is allocated or written."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from ..backends.disk import aligned
from ..config import HOST_BUDGET_ALLOWED, Problems
from ..config import env_or_none as env_value
from ..config import host_budget as read_budget
from ..errors import ConfigError
from ..planning.tiers import budget_rows, folder_problem, read_trace, warm_experts
from .find import LayerPlan


@dataclass(frozen=True)
class TierOptions:
    """A disk tier as asked for: the budget, the folder, and the names they came by."""

    budget: object = None
    spill_dir: object = None
    budget_name: str = "host_budget"  # or "MOEPAGE_HOST_BUDGET"
    spill_name: str = "spill_dir"  # or "MOEPAGE_SPILL_DIR"
    warm: object = None  # a routing trace: the experts each layer's host tier starts with
    warm_name: str = "host_warm"  # or "MOEPAGE_HOST_WARM"


def tier_options(host_budget: object, spill_dir: object, host_warm: object = None) -> TierOptions:
    """The arguments, each one not given taken from its variable (an unreadable variable is said elsewhere, once); a
    folder's ``~`` expanded (a trace's: ``read_trace``)."""
    names = {}
    if host_budget is None and (value := env_value("MOEPAGE_HOST_BUDGET")) is not None:
        host_budget, names["budget_name"] = value, "MOEPAGE_HOST_BUDGET"
    if spill_dir is None and (value := env_value("MOEPAGE_SPILL_DIR")) is not None:
        spill_dir, names["spill_name"] = value, "MOEPAGE_SPILL_DIR"
    if host_warm is None and (value := env_value("MOEPAGE_HOST_WARM")) is not None:
        host_warm, names["warm_name"] = value, "MOEPAGE_HOST_WARM"
    if isinstance(spill_dir, (str, os.PathLike)):  # "~/rows" is the home's, as a shell would read it, not "./~/rows"
        spill_dir = os.path.expanduser(spill_dir)
    return TierOptions(host_budget, spill_dir, warm=host_warm, **names)


def budget_value(options: TierOptions) -> int | str:
    """The budget as host rows (an int) or a byte size (a str), else a ``ConfigError`` naming it and what is allowed."""
    budget = options.budget
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise ConfigError(f"{options.budget_name}={budget!r} ({type(budget).__name__}): expected {HOST_BUDGET_ALLOWED}")
    try:  # an int too: the rule (at or below zero refused) is the text's, the variable's and the engines' flag's
        return read_budget(str(budget))
    except ValueError as exc:
        raise ConfigError(f"{options.budget_name}={budget!r}: {exc}") from None


def held_rows(options: TierOptions, plans: list[LayerPlan], problems: Problems, writes_rows: bool,
              loader_writes: int = 0, caller: str = "moepage.wrap") -> dict[str, int] | None:
    """H of every layer, its rows held in host memory (None: no disk tier, asked for or needed, or a problem said to
    ``problems``). ``writes_rows``: moepage writes every row into the folder (no loader lays them out in place, or
    they are coded), so the folder needs their bytes free (raw, each at its 4 KiB boundary: no coded row is larger);
    ``loader_writes``: bytes a loader writes there besides (rows it casts, ``sources.Load``); ``caller``: the call a
    warning names."""
    if options.budget is None:
        if options.spill_dir is not None and options.spill_name == "spill_dir":  # the variable alone: a default folder
            problems.add(f"spill_dir={options.spill_dir!r} is for host_budget= (experts kept on disk); pass both or "
                         "neither")
        return None
    try:
        budget = budget_value(options)
    except ConfigError as exc:
        problems.add(str(exc))
        budget = None
    held = None if budget is None or not plans else budget_rows(
        f"{options.budget_name}={budget!r}", budget, sum(sum(s.nbytes for s in p.specs.values()) for p in plans),
        len(plans), {p.name: (p.num_slots, p.num_experts) for p in plans}, problems)
    if held is not None and held.every is not None:
        warnings.warn(f"{caller}: {held.every}", stacklevel=5)  # past prepare, wrap and torch's decorator
        return None
    if options.spill_dir is None:
        problems.add(f"{options.budget_name}={options.budget!r} keeps experts on disk: pass spill_dir= (or set "
                     "MOEPAGE_SPILL_DIR), the folder where moepage keeps the rows it writes")
    written = sum(p.num_experts * sum(aligned(s.nbytes) for s in p.specs.values()) for p in plans)
    need = (written if writes_rows else 0) + loader_writes
    if options.spill_dir is not None and (why := folder_problem(options.spill_dir, need)):
        problems.add(f"{options.spill_name}={options.spill_dir!r}: {why}")
    return None if held is None else held.rows


def warm_experts_of(options: TierOptions, plans: list[LayerPlan], held: dict[str, int] | None,
                    problems: Problems, caller: str = "moepage.wrap") -> dict[str, list[int]]:
    """Each layer's experts its host tier starts with (``host_warm``: those the trace routes to most, at most H),
    or a problem said to ``problems``; {} without a trace."""
    if options.warm is None:
        return {}
    if options.budget is None:
        problems.add(f"{options.warm_name}={options.warm!r} is for host_budget= (it says which experts the host tier "
                     "starts with); pass the budget or drop it")
        return {}
    if held is None or not plans:
        return {}  # the budget's own problem is said
    try:
        out = {p.name: warm_experts(options.warm, i, p.name, p.num_experts, held[p.name]) for i, p in enumerate(plans)}
        layers = len(read_trace(options.warm, plans[0].num_experts).layers)
    except ValueError as exc:
        problems.add(f"{options.warm_name}={options.warm!r}: {exc}")
        return {}
    if layers > len(plans):  # experts modules wrapped one at a time, say: each would take the trace's first layer
        warnings.warn(f"{caller}: {options.warm_name}={options.warm!r} has {layers} MoE layers, this call pages "
                      f"{len(plans)}: they are warmed from the trace's first {len(plans)} (wrap the whole model to "
                      "warm each layer from its own)", stacklevel=5)  # past prepare, wrap and its decorator
    return out
