"""``wrap``: one verb that walks a module and pages every experts module it finds.

An *experts module* follows the Hugging Face v5 convention: stacked per-expert parameters with a
leading expert dimension E (``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` by default,
other names through ``params=``) and ``forward(hidden_states, top_k_index, top_k_weights)``.
Every other direct parameter whose leading dimension is E (biases, scales) is paged too.

Everything about the input is checked before anything is allocated; a failure part-way through a
model undoes the layers already paged.
"""

from __future__ import annotations

import inspect
import operator
import os
from typing import Callable, Iterable, Mapping, Sequence

import torch

from . import backends, module_hooks, telemetry
from ._env import env_flag
from .errors import ConfigError
from .executor import LayerStats, PagedLayer, attach, paged_layer
from .pager import LayerPager, PagerOptions, wants_device_planner
from .prefetch import Predictor, PrefetchLink, links as prefetch_links
from .residency import DEFAULT_POLICY, Policy, resolve_policy
from .runners import Runner, runner_for
from .store import PagedExpertStore, RowSpec

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


def find_experts(
    module: torch.nn.Module, params: Sequence[str] | None = None
) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, module)`` of every routed experts module in ``module`` (itself
    included): stacked per-expert parameters and a forward that takes the routing."""
    return [(n, m) for n, m in module.named_modules() if _matched_params(m, params) is not None and takes_routing(m)]


def dense_experts(
    module: torch.nn.Module, params: Sequence[str] | None = None
) -> list[tuple[str, torch.nn.Module]]:
    """Stacked experts modules whose forward takes no routing: they compute every expert for
    every token (shared experts; or routed experts computed densely, as Llama 4's), so there is
    nothing to page. ``wrap`` leaves them as they are, and refuses a model that has only those."""
    return [(n, m) for n, m in module.named_modules() if _matched_params(m, params) is not None and not takes_routing(m)]


def stack_problem(module: torch.nn.Module, params: Sequence[str] | None = None) -> str | None:
    """Why the stacked parameters of an experts module are no per-expert rows (they disagree on
    the number of experts), or None."""
    matched = _matched_params(module, params) or ()
    rows = {n: module._parameters[n].shape[0] if module._parameters[n].dim() else 0 for n in matched}
    if len(set(rows.values())) <= 1:
        return None
    return (f"its stacked parameters disagree on the number of experts ({', '.join(f'{n} has {r} rows' for n, r in rows.items())}); "
            "moepage pages experts that have one row of every stacked parameter each (experts without "
            "weights of their own, such as identity 'zero' experts, cannot be paged)")


def dense_reason(qual: str, module: torch.nn.Module) -> str:
    return (f"{qual or type(module).__name__}: {type(module).__name__} stacks its expert weights but its "
            f"forward{inspect.signature(type(module).forward)} does not take the routing (hidden_states, "
            "top_k_index, top_k_weights): it computes every expert itself, so moepage cannot page it")


def takes_routing(module: torch.nn.Module) -> bool:
    """Whether the module's ``forward`` takes ``(hidden_states, top_k_index, top_k_weights)``."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return True
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 3


def _top_k_of(module: torch.nn.Module, root: torch.nn.Module) -> int | None:
    for owner in (module, root):
        config = getattr(owner, "config", None)
        for value in (getattr(config, "num_experts_per_tok", None), getattr(owner, "top_k", None)):
            if isinstance(value, int):
                return value
    return None


def _as_slot_count(resident: object, what: str = "resident") -> int:
    if isinstance(resident, bool):
        raise ConfigError(f"{what} must be an integer number of slots, got {resident!r}")
    try:
        return operator.index(resident)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(
            f"{what} must be an integer number of slots (or a {{layer: K}} split, or a split file), "
            f"got {resident!r} ({type(resident).__name__})"
        ) from None


def _slot_counts(resident: object, names: list[str]) -> list[int]:
    """K of every layer in ``names``: one integer for all, a ``{layer: K}`` split (keys: module
    names, or a layer's index among the experts modules), or a split file's path (``moepage plan
    --trace T --budget N --out F``)."""
    if isinstance(resident, (str, os.PathLike)):
        from .budgets import load_split

        try:
            resident = load_split(resident)
        except ConfigError as exc:  # it names the file
            raise ConfigError(f"resident: {exc}") from None
    if not isinstance(resident, Mapping):
        return [_as_slot_count(resident)] * len(names)
    known = set(names) | set(range(len(names)))
    unknown = [key for key in resident if key not in known]
    missing = [n for i, n in enumerate(names) if n not in resident and i not in resident]
    if unknown or missing:
        raise ConfigError(
            f"resident split: keys {unknown} name no experts module and layers {missing} have no K; "
            f"the layers are {names} (or their indices 0..{len(names) - 1})"
        )
    return [_as_slot_count(resident[n] if n in resident else resident[i], f"resident[{n!r}]") for i, n in enumerate(names)]


def as_device(device: object) -> torch.device:
    """``device`` as a ``torch.device`` that this machine has, else a ``ConfigError`` (raised
    before anything is allocated, not torch's error at the first allocation)."""
    try:
        target = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        raise ConfigError(f"device={device!r} is not a torch device; pass e.g. 'cuda', 'cuda:1' or 'cpu'") from None
    if target.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "no CUDA GPU or driver was found"
            raise ConfigError(f"device={device!r}: CUDA is not available here ({why}); pass device='cpu' or run where a CUDA GPU is")
        count = torch.cuda.device_count()
        if target.index is not None and target.index >= count:
            raise ConfigError(f"device={device!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    elif target.type not in ("cpu", "meta"):
        accelerator = getattr(torch, "accelerator", None)
        found = accelerator.current_accelerator() if accelerator is not None else None
        if found is None or found.type != target.type:
            raise ConfigError(f"device={device!r}: no {target.type} device is available here; pass device='cpu'")
    return target


def _plan_layer(
    name: str,
    module: torch.nn.Module,
    root: torch.nn.Module,
    k: int,
    params: Sequence[str] | None,
    num_experts: int | None,
    top_k: int | None,
    problems: list[str],
    allow_meta: bool = False,
) -> tuple[dict[str, RowSpec], int, int | None]:
    """Row specs, E and top_k of one layer; appends what is wrong with it to ``problems``."""
    label = f"layer {name} ({type(module).__name__})"
    if paged_layer(module) is not None:
        problems.append(f"{label}: is already wrapped by moepage (call moepage.unwrap first)")
        return {}, 0, None
    matched = _matched_params(module, params)
    assert matched is not None
    if num_experts is None and (why := stack_problem(module, params)):
        problems.append(f"{label}: {why}")
        return {}, 0, None
    e = num_experts or module._parameters[matched[0]].shape[0]
    declared_e = getattr(module, "num_experts", None)
    if isinstance(declared_e, int) and declared_e != e:
        problems.append(f"{label}: num_experts={declared_e} but {matched[0]} has {e} rows")
    names = list(matched) + [
        n for n, p in module._parameters.items()
        if n not in matched and p is not None and p.dim() >= 1 and p.shape[0] == e
    ]
    specs: dict[str, RowSpec] = {}
    for n in names:
        p = module._parameters[n]
        where = f"{label}: parameter {n!r}"
        if type(p.data) is not torch.Tensor or p.layout != torch.strided:
            problems.append(f"{where}: unsupported tensor type/layout {type(p.data).__name__}/{p.layout}; need a dense strided tensor")
        elif p.is_meta and not allow_meta:
            problems.append(f"{where}: is on the meta device; load weights first (or use a moepage loader)")
        elif p.dtype not in SUPPORTED_DTYPES:
            allowed = ", ".join(sorted(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES))
            problems.append(f"{where}: unsupported dtype {p.dtype}; supported: {allowed}")
        elif p.dim() < 1 or p.shape[0] != e:  # [E] per-expert scalars (scales) page as 0-d rows
            problems.append(f"{where}: shape {tuple(p.shape)} has no leading expert dimension of {e}")
        specs[n] = RowSpec(tuple(p.shape[1:]), p.dtype)
    tk = top_k if top_k is not None else _top_k_of(module, root)
    if k < 1 or k > e:
        problems.append(f"{label}: resident={k} is outside 1..num_experts={e}")
    elif tk is not None and k < tk:
        problems.append(f"{label}: resident={k} is below top_k={tk}; a step needs at least top_k slots")
    return specs, e, tk


# Host rows, slots and device state are ordinary tensors even when wrap runs under
# torch.inference_mode(): steps outside it write into them.
@torch.inference_mode(False)
def wrap(
    module: torch.nn.Module,
    resident: int | Mapping[str | int, int] | str | os.PathLike,
    *,
    backend: str | PagedExpertStore | None = None,
    device: str | torch.device | None = None,
    params: Sequence[str] | None = None,
    num_experts: int | None = None,
    top_k: int | None = None,
    implementation: str | Runner | None = None,
    verify: bool | None = None,
    name: str | None = None,
    device_planner: bool | None = None,
    prefill_overlap: bool = False,
    policy: str | Policy | None = None,
    prefill_admit: int | None = None,
    load: Callable[[PagedExpertStore, Mapping[str, Mapping[str, RowSpec]]], None] | None = None,
    prefetch: bool | int | Mapping[str, Predictor] | None = None,
) -> torch.nn.Module:
    """Page the routed experts of ``module`` (an experts module or a whole model) with
    ``resident`` = K slots per layer; returns ``module``, changed in place.

    - ``resident``: K for every layer; or a per-layer split, ``{layer: K}`` (module names or the
      layers' indices among the experts modules) or the path of a split file written by
      ``moepage plan --trace T --budget N --out F``.
    - ``backend``: "cuda", "torch", "mock" or a ``PagedExpertStore``; default: "cuda" when the
      device is CUDA and cuda-python is installed, else "torch".
    - ``device``: where the slots go (default: where the expert parameters are). For a whole
      model the rest of it is moved there too.
    - ``params``: names of the per-expert parameters when they are not HF's
      ``gate_up_proj``/``down_proj``; ``num_experts`` / ``top_k`` when the module does not say.
    - ``implementation``: the runner, a registered name ("expert_order", "topk_sum", HF's
      "eager", "grouped_mm", "batched_mm", "deepgemm") or a ``moepage.Runner``; default: what a
      registered resolver says of the module (HF: ``config._experts_implementation``), else
      "expert_order".
    - ``verify``: after every page-in, check slots against host rows (or ``MOEPAGE_VERIFY=1``).
    - ``device_planner``: plan steps on the device, with no host sync (CUDA-graph capturable): a
      step of at most K routed entries always, any step while a graph is captured (in waves of K)
      or inside ``moepage.capture_mode()``. Default: on where the slots are on CUDA and the
      backend can gather a device-made plan (``cuda``); ``True`` also enables it for the ``torch``
      backend on CPU.
    - ``prefill_overlap``: in steps of several waves (prefill), page wave i+1 in while wave i
      computes (a CUDA copy stream; waves of at most K // 2 experts). Output unchanged.
    - ``policy``: the eviction policy, "lru", "lfu", "lfru", "lfu:H" / "lfru:H" or a
      ``moepage.Policy``; default ``moepage.DEFAULT_POLICY``. Host and device planners apply it alike.
    - ``prefill_admit``: a host-planned step of more than K experts (prefill) evicts into at most
      this many slots, so the rest keep the decode working set (``residency.plan_waves``).
    - ``load``: fill the host rows yourself (a checkpoint loader): called as
      ``load(store, {layer: {param: RowSpec}})`` once every layer's host rows and slots are
      allocated, before any slot is filled; a layer's key is its module's qualified name in
      ``module``. Expert parameters may then be on the meta device (their shape and dtype give the
      rows); ``device=`` is required. If ``load`` raises, everything allocated is released.
    - ``prefetch``: while a layer runs, page the experts predicted for the next paged layer in
      (``moepage.prefetch``; output unchanged). ``True``: the next layer's router on this layer's
      experts input, its top_k per token; an int m: its top-m; ``{experts module name:
      predictor}``: a callable (hidden [T, H] -> expert ids [T, m]) run in the layer before it.
      Default off.

    K > E is an error (not clamped): pass ``resident=E`` to keep every expert resident.
    """
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(
            f"moepage.wrap: module must be a torch.nn.Module (an experts module or a whole model), "
            f"got {type(module).__name__} {module!r:.60}"
        )
    target_device = as_device(device) if device is not None else None
    try:
        policy = resolve_policy(DEFAULT_POLICY if policy is None else policy)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"moepage.wrap: policy: {exc}") from None
    targets = find_experts(module, params)
    if not targets and (dense := dense_experts(module, params)):
        raise ConfigError("moepage.wrap: cannot page this model:\n  - " + "\n  - ".join(dense_reason(q, m) for q, m in dense))
    if not targets:
        wanted = " + ".join(params) if params else " or ".join("+".join(p) for p in DEFAULT_PARAMS)
        raise ConfigError(
            f"{type(module).__name__}: no experts module found (looked for parameters {wanted}); "
            "pass params=[...] to name the per-expert parameters"
        )
    names = [qual or name or type(sub).__name__ for qual, sub in targets]
    slot_counts = _slot_counts(resident, names)
    problems: list[str] = []
    if prefill_admit is not None:
        least = 2 if prefill_overlap else 1  # overlapped waves take half of what they may evict into
        admit = _as_slot_count(prefill_admit, "prefill_admit")
        if not least <= admit <= min(slot_counts):
            problems.append(f"prefill_admit={admit} is outside {least}..K={min(slot_counts)} (the smallest K)")
    plans = []
    layer_infos = []  # (name, qualified name, module, E, top_k): what prefetch= is resolved against
    for layer_name, k, (qual, sub) in zip(names, slot_counts, targets):
        specs, e, tk = _plan_layer(layer_name, sub, module, k, params, num_experts, top_k, problems, load is not None)
        layer_infos.append((layer_name, qual, sub, e, tk))
        try:
            runner_for(sub, implementation)  # checked now; each step asks again (the module may switch)
        except ConfigError as exc:
            problems.append(f"layer {layer_name} ({type(sub).__name__}): {exc}")
        plans.append((layer_name, sub, specs, e, k))
    devices = {p.device for _, sub, specs, *_ in plans for n, p in sub._parameters.items() if n in specs}
    if target_device is None and len(devices) == 1:
        target_device = devices.pop()
    if target_device is None:
        if devices:  # none: every layer is already refused above
            problems.append(f"expert parameters span devices {sorted(map(str, devices))}; pass device=")
    elif target_device.type == "meta":
        problems.append("expert parameters are on the meta device; pass device= (where the slots go)")
    if problems:
        raise ConfigError("moepage.wrap: cannot page this model:\n  - " + "\n  - ".join(problems))
    predictors = prefetch_links(prefetch, module, layer_infos)

    owns_store = not isinstance(backend, PagedExpertStore)
    store = backends.resolve(backend, target_device)
    try:
        wants_device_planner(store, target_device, device_planner, "moepage.wrap")
    except ConfigError:
        if owns_store:
            store.close()
        raise
    verify = env_flag("MOEPAGE_VERIFY") if verify is None else verify
    options = PagerOptions(verify=verify, device_planner=device_planner, overlap=prefill_overlap, policy=policy,
                           admit=prefill_admit)
    done: list[torch.nn.Module] = []
    loaded: list[str] = []  # allocated for ``load``, not yet handed to _page_layer
    try:
        if load is not None:
            for layer_name, sub, specs, e, k, *_ in plans:
                store.allocate(layer_name, specs, e, k, target_device)
                loaded.append(layer_name)
            load(store, {layer_name: specs for layer_name, _, specs, *_ in plans})
        for layer_name, sub, specs, e, k in plans:
            if load is not None:
                loaded.remove(layer_name)  # _page_layer releases it if it fails
            _page_layer(layer_name, sub, store, specs, e, k, target_device, load is not None, implementation, options)
            done.append(sub)
        for i, predictor in predictors.items():  # layer i prefetches for layer i + 1
            paged_layer(plans[i][1]).prefetch = PrefetchLink(paged_layer(plans[i + 1][1]).pager, predictor)
    except BaseException:
        for layer_name in loaded:
            store.release(layer_name)
        for sub in reversed(done):
            unwrap(sub)
        if owns_store:
            store.close()
        raise
    if device is not None and module not in done:
        module.to(target_device)
    return module


def _page_layer(
    name: str,
    module: torch.nn.Module,
    store: PagedExpertStore,
    specs: dict[str, RowSpec],
    e: int,
    k: int,
    device: torch.device,
    preloaded: bool,
    implementation: str | Runner | None,
    options: PagerOptions,
) -> None:
    """Move one experts module's rows into the store (unless ``preloaded``), fill its slots with
    experts 0..K-1, swap its parameters for the slots (each keeps its ``requires_grad``), attach its
    ``PagedLayer`` and install its module hooks (``module_hooks``)."""
    if not preloaded:  # else allocated and filled by wrap's ``load``
        store.allocate(name, specs, e, k, device)
    try:
        for n in specs:
            host = store.host_rows(name, n)
            if not preloaded:
                host.copy_(module._parameters[n].detach())
            slots = store.slots(name, n)
            slots.copy_(host[:k])  # the residency starts with experts 0..K-1 in slots 0..K-1
        pager = LayerPager(name, store, specs, e, k, options)
        layer = PagedLayer(pager, module, implementation, module.forward)
    except BaseException:
        store.release(name)
        raise
    if preloaded:
        layer.original_device = device  # the parameters were meta: unwrap puts them on the device
    for n in specs:
        requires_grad = module._parameters[n].requires_grad
        module._parameters[n] = torch.nn.Parameter(store.slots(name, n), requires_grad=requires_grad)
    if isinstance(getattr(module, "num_experts", None), int):
        module.num_experts = k  # the module now computes over K slot rows
    attach(module, layer)
    layer.module_hooks = module_hooks.install(module, layer)


@torch.inference_mode(False)
def unwrap(module: torch.nn.Module, *, discard_slot_edits: bool = False) -> torch.nn.Module:
    """Undo ``wrap``: give every paged experts module its E-row parameters back (on the device
    they came from, from the host rows) and free its host rows and slots.

    Slot tables written in place after wrap (an edit of ``model.parameters()``, which reaches only
    the K resident experts) are refused before anything is undone, since unwrapping drops such an
    edit; ``discard_slot_edits=True`` unwraps anyway. Edits of the host rows (``state_dict()``
    entries) are kept: they are what unwrap gives back."""
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"moepage.unwrap: module must be a torch.nn.Module, got {type(module).__name__} {module!r:.60}")
    layers = [(sub, layer) for _, sub in module.named_modules() if (layer := paged_layer(sub)) is not None]
    edited = {layer.name: names for _, layer in layers if (names := layer.pager.slot_edits())}
    if edited and not discard_slot_edits:
        raise ConfigError(
            f"moepage.unwrap: slot tables written in place after wrap would be lost: {edited}. Those edits reached "
            "only the resident experts; make them in the host rows (model.state_dict() entries) instead, or call "
            "moepage.unwrap(model, discard_slot_edits=True) to drop them"
        )
    for sub, layer in layers:
        for handle in layer.module_hooks:
            handle.remove()
        for n in layer.specs:
            host = layer.store.host_rows(layer.name, n)
            requires_grad = sub._parameters[n].requires_grad  # as wrapped, or as set since
            sub._parameters[n] = torch.nn.Parameter(host.to(layer.original_device, copy=True), requires_grad=requires_grad)
        if isinstance(getattr(sub, "num_experts", None), int):
            sub.num_experts = layer.num_experts
        if getattr(layer.original_forward, "__func__", None) is type(sub).forward:
            del sub.forward  # back to the class's forward
        else:
            sub.forward = layer.original_forward
        del sub._moepage
        layer.pager.release()  # after any pending prefetch into its slots
    return module


class Stats(dict):
    """``{layer name: LayerStats}``, with ``total`` summed over layers; ``print`` shows a table."""

    @property
    def total(self) -> LayerStats:
        return sum(self.values(), LayerStats())

    def __str__(self) -> str:
        return telemetry.table(self)


def stats(module: torch.nn.Module) -> Stats:
    """Per-layer counters of every paged layer in ``module``: steps, waves, hits, misses,
    experts and bytes paged in, hit rate."""
    return Stats((layer.name, layer.stats) for layer in paged_layers(module))


def paged_layers(module: torch.nn.Module) -> Iterable[PagedLayer]:
    for _, sub in module.named_modules():
        layer = paged_layer(sub)
        if layer is not None:
            yield layer
