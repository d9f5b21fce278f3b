"""Which modules of a model are experts modules, and each one's plan (tensors, E, top_k, K), every
problem found before anything is allocated.

An experts module holds stacked per-expert parameters (``gate_up_proj`` + ``down_proj`` or
``up_proj`` + ``down_proj`` by default, ``params=`` otherwise; every other direct parameter with
leading dimension E is paged too) and computes ``forward(hidden_states, top_k_index,
top_k_weights)``. A stacked module whose forward takes no routing computes every expert itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..backends.protocol import RowSpec
from ..config import Problems
from ..errors import ConfigError
from ..residency import k_problem
from .layer import paged_layer

DEFAULT_PARAMS: tuple[tuple[str, ...], ...] = (("gate_up_proj", "down_proj"), ("up_proj", "down_proj"))
SUPPORTED_DTYPES = frozenset(
    {torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32}
    | {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}
)


def _matched_params(module: torch.nn.Module, params: Sequence[str] | None) -> tuple[str, ...] | None:
    candidates = (tuple(params),) if params else DEFAULT_PARAMS
    for names in candidates:
        if all(isinstance(module._parameters.get(n), torch.Tensor) for n in names):
            return names
    return None


def _paged_names(module: torch.nn.Module, matched: Sequence[str], e: int) -> list[str]:
    """The parameters paged as host rows: the matched ones and every other with leading dimension E."""
    return list(matched) + [n for n, p in module._parameters.items()
                            if n not in matched and p is not None and p.dim() >= 1 and p.shape[0] == e]


def row_bytes(module: torch.nn.Module, rows: int | None = None, params: Sequence[str] | None = None) -> int:
    """Bytes of ``rows`` expert rows (None: all E, the host rows ``wrap`` allocates) of an experts module's paged
    parameters; meta parameters too, so a loader can size them before reading a weight."""
    matched = _matched_params(module, params)
    if matched is None:
        return 0
    e = module._parameters[matched[0]].shape[0]
    one = sum(module._parameters[n][0].numel() * module._parameters[n].element_size()
              for n in _paged_names(module, matched, e)) if e else 0
    return one * (e if rows is None else min(rows, e))


def takes_routing(module: torch.nn.Module) -> bool:
    """Whether the module's ``forward`` takes ``(hidden_states, top_k_index, top_k_weights)``."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return True
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 3


def check_module(verb: str, module: object) -> None:
    """What every entry point taking a model checks first: ``module`` is a ``torch.nn.Module``."""
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"moepage.{verb}: module must be a torch.nn.Module (an experts module or a whole model), "
                          f"got {type(module).__name__} {module!r:.60}")


def find_experts(module: torch.nn.Module, params: Sequence[str] | None = None) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, module)`` of every routed experts module in ``module`` (itself
    included): stacked per-expert parameters and a forward that takes the routing."""
    return [(n, m) for n, m in module.named_modules() if _matched_params(m, params) is not None and takes_routing(m)]


def dense_experts(module: torch.nn.Module, params: Sequence[str] | None = None) -> list[tuple[str, torch.nn.Module]]:
    """Stacked experts modules whose forward takes no routing: ``wrap`` leaves them as they are,
    and refuses a model that has only those."""
    return [(n, m) for n, m in module.named_modules()
            if _matched_params(m, params) is not None and not takes_routing(m)]


def dense_reason(module: torch.nn.Module) -> str:
    signature = inspect.signature(type(module).forward)
    return (f"{type(module).__name__} stacks its expert weights but its forward{signature} does not take the "
            "routing (hidden_states, top_k_index, top_k_weights): it computes every expert itself, so moepage "
            "cannot page it")


def stack_problem(module: torch.nn.Module, params: Sequence[str] | None = None) -> str | None:
    """Why the stacked parameters of an experts module are no per-expert rows (they disagree on
    the number of experts), or None."""
    matched = _matched_params(module, params) or ()
    rows = {n: module._parameters[n].shape[0] if module._parameters[n].dim() else 0 for n in matched}
    if len(set(rows.values())) <= 1:
        return None
    said = ", ".join(f"{n} has {r} rows" for n, r in rows.items())
    return (f"its stacked parameters disagree on the number of experts ({said}); "
            "moepage pages experts that have one row of every stacked parameter each (experts without "
            "weights of their own, such as identity 'zero' experts, cannot be paged)")


def top_k_of(module: torch.nn.Module, root: torch.nn.Module) -> int | None:
    """The router's top_k, as the module or the model declares it (``config.num_experts_per_tok``
    or a ``top_k`` attribute)."""
    stated = _stated_top_k(module, root)
    return None if stated is None else stated[0]


def _stated_top_k(module: torch.nn.Module, root: torch.nn.Module) -> tuple[int, str] | None:
    """``top_k_of``'s value and where it is stated."""
    for owner, whose in ((module, "the module's"), (root, "the model's")):
        config = getattr(owner, "config", None)
        for value, where in ((getattr(config, "num_experts_per_tok", None), "config.num_experts_per_tok"),
                             (getattr(owner, "top_k", None), "top_k")):
            if isinstance(value, int) and not isinstance(value, bool):
                return value, f"{whose} {where}"
    return None


def _conflict(what: str, given: int | None, stated: int | None, where: str) -> str | None:
    """Why argument ``what`` = ``given`` is refused: the module states another value (``where``); None if it does
    not, or agrees. The arguments are for modules that do not say."""
    if given is None or stated is None or given == stated:
        return None
    return f"{what}={given} was passed, but {where} is {stated}; pass {what}={stated} or leave it out"


def as_device(device: object) -> torch.device:
    """``device`` as a ``torch.device`` that this machine has, as tensors report it (``cpu:0`` is ``cpu``; a bare
    ``cuda`` is the current CUDA device), else a ``ConfigError`` (raised before anything is allocated, not torch's
    error at the first allocation)."""
    try:
        target = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        raise ConfigError(f"device={device!r} is not a torch device; pass e.g. 'cuda', 'cuda:1' or 'cpu'") from None
    if target.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "no CUDA GPU or driver was found"
            raise ConfigError(f"device={device!r}: CUDA is not available here ({why}); "
                              "pass device='cpu' or run where a CUDA GPU is")
        count = torch.cuda.device_count()
        if target.index is not None and target.index >= count:
            raise ConfigError(f"device={device!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
        return target if target.index is not None else torch.device("cuda", torch.cuda.current_device())
    if target.type in ("cpu", "meta"):
        return torch.device(target.type)  # tensors there carry no index: "cpu:0" would never equal their device
    accelerator = getattr(torch, "accelerator", None)
    found = accelerator.current_accelerator() if accelerator is not None else None
    if found is None or found.type != target.type:
        raise ConfigError(f"device={device!r}: no {target.type} device is available here; pass device='cpu'")
    return target


@dataclass(frozen=True)
class LayerPlan:
    """One experts module to page: its store key, where it sits, its row specs, E, K, top_k."""

    name: str  # the store key: the qualified name (or wrap's name= for a module paged on its own)
    qual: str  # the qualified name in the wrapped module ("" for the module itself)
    module: torch.nn.Module
    specs: Mapping[str, RowSpec]
    num_experts: int
    num_slots: int
    top_k: int | None


def plan_layer(name: str, qual: str, module: torch.nn.Module, root: torch.nn.Module, k: int | None,
               params: Sequence[str] | None, num_experts: int | None, top_k: int | None, problems: Problems,
               allow_meta: bool = False) -> LayerPlan | None:
    """The plan of one experts module; what is wrong with it goes to ``problems`` (then None)."""
    found: list[str] = []
    plan = _plan(name, qual, module, root, k, params, num_experts, top_k, found, allow_meta)
    for text in found:
        problems.add(text, f"{name} ({type(module).__name__})")
    return None if found else plan


def _plan(name, qual, module, root, k, params, num_experts, top_k, found: list[str],
          allow_meta: bool) -> LayerPlan | None:
    if paged_layer(module) is not None:
        found.append("is already wrapped by moepage (call moepage.unwrap first)")
        return None
    matched = _matched_params(module, params)
    assert matched is not None
    if num_experts is None and (why := stack_problem(module, params)):
        found.append(why)
        return None
    e = num_experts or module._parameters[matched[0]].shape[0]
    declared_e = getattr(module, "num_experts", None)
    if isinstance(declared_e, int) and not isinstance(declared_e, bool) and declared_e != e:
        found.append(_conflict("num_experts", num_experts, declared_e, "the module's num_experts")
                     or f"num_experts={declared_e} but {matched[0]} has {e} rows")
    names = _paged_names(module, matched, e)
    specs: dict[str, RowSpec] = {}
    for n in names:
        p = module._parameters[n]
        if type(p.data) is not torch.Tensor or p.layout != torch.strided:
            found.append(f"parameter {n!r}: unsupported tensor type/layout {type(p.data).__name__}/{p.layout}; "
                         "need a dense strided tensor")
        elif p.is_meta and not allow_meta:
            found.append(f"parameter {n!r} is on the meta device; load weights first (or use a moepage loader)")
        elif p.dtype not in SUPPORTED_DTYPES:
            allowed = ", ".join(sorted(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES))
            found.append(f"parameter {n!r}: unsupported dtype {p.dtype}; supported: {allowed}")
        elif p.dim() < 1 or p.shape[0] != e:  # [E] per-expert scalars (scales) page as 0-d rows
            found.append(f"parameter {n!r}: shape {tuple(p.shape)} has no leading expert dimension of {e}")
        specs[n] = RowSpec(tuple(p.shape[1:]), p.dtype)
    stated = _stated_top_k(module, root)
    if stated is not None and (why := _conflict("top_k", top_k, *stated)):
        found.append(why)
    tk = top_k if top_k is not None else top_k_of(module, root)
    if k is not None and (why := k_problem(k, e, tk)):  # None: K was unreadable, said once for the model
        found.append(why)
    return LayerPlan(name, qual, module, specs, e, k or 0, tk)
