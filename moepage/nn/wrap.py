"""``wrap``: one verb that walks a module and pages every experts module it finds (``nn.find``),
and ``unwrap``, ``stats``, ``paged_layers``.

Everything about the input is checked before anything is allocated, and reported in one
``ConfigError`` (``config.Problems``: a problem common to several layers is said once). The
layers' store, rows and slots belong to one ``lifetime.Lifetime``: a failure part-way through a
model undoes the layers already paged, and unwrapping the last layer closes a store wrap made.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping, Sequence

import torch

from .. import backends
from ..backends.protocol import HostBytes, PagedExpertStore
from ..config import (
    PagingConfig,
    Problems,
    compress_problem,
    device_planner_problem,
    env,
    listed,
    slot_count,
    split_k,
)
from ..contract import CpuExpert, Runner, cpu_expert_for, diagnoses, runner_for
from ..errors import ConfigError
from ..lifetime import Lifetime, page_layer, plan_codes
from ..pager import LayerPager, can_plan_on_device
from ..prefetch import Predictor, PrefetchLink
from ..progress import progress
from ..residency import Policy
from ..telemetry import Stats
from . import hooks
from .find import (
    DEFAULT_PARAMS,
    LayerPlan,
    as_device,
    check_module,
    dense_experts,
    dense_reason,
    find_experts,
    plan_layer,
)
from .layer import PagedLayer, attach, paged_layer
from .prefetch import links as prefetch_links
from .sources import Load, Loader, caller_of, layer_sources
from .tier import held_rows, tier_options, warm_experts_of


def _slot_counts(resident: object, names: list[str], problems: Problems) -> list[int] | None:
    """K of every layer in ``names``: one integer for all, a ``{layer: K}`` split (keys: module
    names, or a layer's index among the experts modules), or a split file's path."""
    if isinstance(resident, (str, os.PathLike)):
        from ..planning.budgets import load_split

        try:
            resident = load_split(resident)
        except ConfigError as exc:  # it names the file
            problems.add(f"resident: {exc}")
            return None
    if not isinstance(resident, Mapping):
        try:
            return [slot_count(resident)] * len(names)
        except ConfigError as exc:
            problems.add(str(exc))
            return None
    known = set(names) | set(range(len(names)))
    unknown = [key for key in resident if key not in known]
    missing = [n for i, n in enumerate(names) if split_k(resident, i, n) is None]
    twice = [f"{n!r} (also as {i})" for i, n in enumerate(names) if n in resident and i in resident]
    if twice:
        problems.add(f"resident split: names layers twice, by name and by index: {', '.join(twice)}; give each "
                     "layer one K")
        return None
    if unknown or missing:
        problems.add(f"resident split: keys {unknown} name no experts module and layers {missing} have no K; "
                     f"the layers are {names} (or their indices 0..{len(names) - 1})")
        return None
    try:
        return [slot_count(split_k(resident, i, n), f"resident[{n!r}]") for i, n in enumerate(names)]
    except ConfigError as exc:
        problems.add(str(exc))
        return None


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
    load: Loader | None = None,
    prefetch: bool | int | Mapping[str, Predictor] | None = None,
    compress: bool | None = None,
    host_budget: int | str | None = None,
    spill_dir: str | os.PathLike | None = None,
    host_warm: str | os.PathLike | None = None,
    cpu_share: bool | float | str | None = None,
) -> torch.nn.Module:
    """Page the routed experts of ``module`` (an experts module or a whole model) with
    ``resident`` = K slots per layer; returns ``module``, changed in place.

    - ``resident``: K for every layer, a ``{layer: K}`` split (module names or indices among the
      experts modules), or a split file from ``moepage plan --trace T --budget N --out F``.
    - ``backend``: "cuda", "torch", "mock" or a ``PagedExpertStore`` (default: "cuda" on CUDA
      with cuda-python installed, else "torch").
    - ``device``: where the slots go (default: where the experts are); a model moves there too.
    - ``params``: the per-expert parameters when not ``gate_up_proj`` / ``down_proj``;
      ``num_experts`` / ``top_k`` when the module does not say.
    - ``implementation``: the runner of a module no integration knows (a registered name or a
      ``moepage.Runner``); a module an integration knows is followed at every call instead.
    - ``verify``: check slots against host rows after every page-in and step (``MOEPAGE_VERIFY``).
    - ``device_planner``: plan on the device, no host sync (capturable); default on where the
      slots are on CUDA and the backend can gather; ``True`` also for ``torch`` on CPU.
    - ``prefill_overlap``: in steps of several waves, page wave i+1 in while wave i computes.
    - ``policy``: "lru", "lfu", "lfru", "lruf", "lfu:H" / "lfru:H" / "lruf:H" (half-life H waves)
      or a ``moepage.Policy`` (default ``MOEPAGE_POLICY``, else ``moepage.DEFAULT_POLICY``).
    - ``prefill_admit``: a host-planned step of more than K experts evicts into at most this many
      slots, so the rest keep the decode working set.
    - ``load``: fill the host rows yourself, ``load(store, {layer: {param: RowSpec}})``, once all
      are allocated; the experts may then be on the meta device (``device=`` required).
    - ``prefetch``: page the next paged layer's predicted experts in while a layer runs: ``True``
      (its router, top_k per token), an int m (top-m) or ``{experts module name: predictor}``
      (hidden [T, H] -> expert ids [T, m]). Default off.
    - ``compress``: keep the host rows losslessly coded (``moepage.compress``, bf16 only; default
      ``MOEPAGE_COMPRESS``), ~1.33x less host memory, decoded into the slots at page-in
      (``moepage.host_bytes`` says what each layer holds). A tensor the code cannot shrink stays
      raw, with a warning saying why. With ``load``, its rows are staged raw (pageable) and coded
      layer by layer. Coding shows progress bars on a terminal (with tqdm).
    - ``host_budget``: keep only part of the experts in host memory, the rest on disk: an int H (host rows per layer,
      H >= K) or a byte size shared by the layers ("64GiB"); one holding every expert (H >= E) makes no disk tier, with
      a warning saying so. ``spill_dir`` is where moepage keeps the rows it
      writes and the layout a later load reuses (``backends.tiered``). Steps are then planned on the host (no
      device planner, no CUDA graph capture); ``stats`` shows the host tier's hits and the disk's bytes and time.
      ``host_warm``: a routing trace of this model (``moepage record``): each layer's host tier starts with the
      experts the trace routes to most (``MOEPAGE_HOST_WARM``).
    - ``cpu_share``: split each eager step's missed experts between the link (paged in, as without it) and the CPU
      (computed from their host rows at the same time): ``"auto"`` (or True: a cost model measured at wrap decides,
      per step, so both finish together; no split where it cannot win), a share in (0, 1] of each step's misses, or
      off (default; ``MOEPAGE_CPU_SHARE``). Not bit-exact: the CPU's GEMMs round differently (docs/cpu-split.md).
      Steps are then planned on the host; a CUDA graph capture is refused.
    """
    check_module("wrap", module)
    caller = caller_of(load)  # from_pretrained's errors name from_pretrained
    target_device = as_device(device) if device is not None else None
    if isinstance(params, (str, bytes)) or (params is not None and not all(isinstance(p, str) for p in params)):
        raise ConfigError(f"params={params!r}: pass the per-expert parameters' names as a list, e.g. "
                          "params=['gate_up_proj', 'down_proj']")
    if load is not None and not callable(load):
        raise ConfigError(f"load={load!r} ({type(load).__name__}) is not callable: pass a function "
                          "load(store, {layer: {param: RowSpec}}) that fills the host rows, or leave it unset")
    targets = find_experts(module, params)
    if not targets and (dense := dense_experts(module, params)):
        raise ConfigError(f"{caller}: cannot page this model:\n  - " + "\n  - ".join(
            f"{q or type(m).__name__}: {dense_reason(m)}" for q, m in dense))
    if not targets:
        wanted = " + ".join(params) if params else " or ".join("+".join(p) for p in DEFAULT_PARAMS)
        said = diagnoses(module)  # an integration may know the layout (e.g. a ModuleList of per-expert MLPs)
        raise ConfigError(f"{caller}: cannot page {type(module).__name__}:\n  - " + "\n  - ".join(
            said or [f"no experts module found (looked for parameters {wanted}); pass params=[...] to name the "
                     "per-expert parameters"]))
    names = [qual or name or type(sub).__name__ for qual, sub in targets]
    problems = Problems()
    ks = _slot_counts(resident, names, problems)  # None: said already; no layer's K is checked against it
    config = PagingConfig.from_options(problems, policy=policy, verify=verify, device_planner=device_planner,
                                       overlap=prefill_overlap, admit=prefill_admit, slot_counts=ks or (),
                                       compress=compress, cpu_share=cpu_share)
    plans: list[LayerPlan] = []
    cpu_experts: dict[str, CpuExpert] = {}  # with cpu_share: each layer's experts on the CPU
    for layer_name, k, (qual, sub) in zip(names, ks or [None] * len(names), targets):
        plan = plan_layer(layer_name, qual, sub, module, k, params, num_experts, top_k, problems, load is not None)
        try:
            runner_for(sub, implementation)  # checked now; each step asks again (the module may switch)
        except ConfigError as exc:
            problems.add(str(exc), f"{layer_name} ({type(sub).__name__})")
        if plan is not None and config.cpu_share is not None:
            if isinstance(found := cpu_expert_problem(sub, plan.specs), str):
                problems.add(f"cpu_share: {found}", f"{layer_name} ({type(sub).__name__})")
            else:
                cpu_experts[plan.name] = found
        if plan is not None:
            plans.append(plan)
            for n, spec in plan.specs.items():
                if config.compress and (why := compress_problem(n, spec.dtype)):
                    problems.add(why, f"{layer_name} ({type(sub).__name__})")
    if config.compress and isinstance(backend, PagedExpertStore) and not backend.compresses:
        problems.add(f"compress=True needs a store that keeps coded rows (moepage's backends); the given "
                     f"{type(backend).__name__} does not say compresses = True")
    tier = tier_options(host_budget, spill_dir, host_warm)
    if tier.budget is not None:
        for why, bad in (("a store of your own", isinstance(backend, PagedExpertStore)),
                         ("device_planner=True (a disk tier pages in host-planned steps only)", config.device_planner)):
            if bad:
                problems.add(f"{tier.budget_name}= does not go with {why}")
    held = held_rows(tier, plans, problems, writes_rows=load is None or bool(config.compress),
                   loader_writes=load.writes if isinstance(load, Load) else 0, caller=caller)
    warm = warm_experts_of(tier, plans, held, problems, caller)
    devices = {p.device for plan in plans for n, p in plan.module._parameters.items() if n in plan.specs}
    if target_device is None and len(devices) == 1:
        target_device = devices.pop()
    if target_device is None and devices:
        problems.add(f"expert parameters span devices {sorted(map(str, devices))}; pass device=")
    elif target_device is not None and target_device.type == "meta":
        problems.add("expert parameters are on the meta device; pass device= (where the slots go)")
    problems.raise_if_any(f"{caller}: cannot page this model", len(names))
    predictors = prefetch_links(prefetch, module, [(p.name, p.qual, p.module, p.num_experts, p.top_k) for p in plans])

    if held is None:
        store = backends.resolve(backend if backend is not None else env("MOEPAGE_BACKEND"), target_device)
    else:
        store = backends.tiered_store(tier.spill_dir, held, target_device, backend or env("MOEPAGE_BACKEND"),
                                      config.policy)
    lifetime = Lifetime(store, owns_store=not isinstance(backend, PagedExpertStore))
    can_gather = can_plan_on_device(store, target_device)
    if why := device_planner_problem(config.device_planner, can_gather, store.name, target_device):
        lifetime.rollback()
        raise ConfigError(f"{caller}: {why}")
    done: list[torch.nn.Module] = []
    raw: list[str] = []  # tensors compress=True keeps raw, and why
    try:
        with layer_sources(plans, lifetime, load, target_device, config.compress) as sources:
            # Coding shows a bar (where tqdm is, on a terminal); plain copies are quick.
            with progress(None if config.compress else False, "coding host rows", "layer") as tick:
                for i, (plan, rows) in enumerate(sources):
                    specs = plan.specs
                    if config.compress and rows is not None:
                        specs, why = plan_codes(specs, rows, chunk=plan.num_slots, device=target_device)
                        raw += [f"{plan.name}.{n}: {reason}" for n, reason in why.items()]
                    pager = page_layer(lifetime, plan.name, specs, plan.num_experts, plan.num_slots, target_device,
                                       config, rows)
                    _attach(plan, pager, lifetime, implementation, preloaded=load is not None, on_disk=held is not None)
                    done.append(plan.module)
                    if pager.split is not None:  # checked against the module on its device, its costs measured
                        pager.split.prepare(pager, cpu_experts[plan.name], paged_layer(plan.module).on_device)
                    if tick is not None and rows is not None:  # (coded rows kept by an earlier load: none coded)
                        tick(i + 1, len(plans))
        for name, experts in warm.items():  # a trace's most used experts: the host tiers start with them
            store.warm(name, experts)
        for i, predictor in predictors.items():  # layer i prefetches for layer i + 1
            paged_layer(plans[i].module).prefetch = PrefetchLink(paged_layer(plans[i + 1].module).pager, predictor)
    except BaseException:
        for sub in reversed(done):
            _restore(sub, paged_layer(sub))
        lifetime.rollback()
        raise
    if raw:
        warnings.warn(f"{caller}: compress=True keeps {len(raw)} expert tensor(s) raw: {listed(raw, 4, '; ')}",
                      stacklevel=2)
    if device is not None and module not in done:
        module.to(target_device)
    return module


def cpu_expert_problem(module: torch.nn.Module, specs: Mapping[str, object]) -> CpuExpert | str:
    """``module``'s ``CpuExpert`` for ``cpu_share``, or why its experts cannot run on the CPU: none registered, or one
    that does not read exactly the layer's paged tensors ``specs``."""
    found = cpu_expert_for(module)
    if isinstance(found, str):
        return found
    if set(found.params) != set(specs):
        return (f"its experts on the CPU ({found.kind}) read {sorted(found.params)}, the layer pages "
                f"{sorted(specs)}; run without cpu_share")
    return found


def _attach(plan: LayerPlan, pager: LayerPager, lifetime: Lifetime, implementation: str | Runner | None,
            preloaded: bool, on_disk: bool) -> None:
    """Swap the module's parameters for the slots (keeping ``requires_grad``), attach its ``PagedLayer`` and hooks.
    ``on_disk``: its rows are on disk (a disk tier), so ``state_dict()`` gives copies of them, as of coded ones."""
    module, store, name = plan.module, lifetime.store, plan.name
    layer = PagedLayer(pager, lifetime, module, implementation, module.forward)
    layer.copied = frozenset(n for n, s in pager.specs.items() if on_disk or s.code is not None)
    if preloaded:
        layer.original_device = pager.device  # the parameters were meta
    for n in plan.specs:
        grad = module._parameters[n].requires_grad
        module._parameters[n] = torch.nn.Parameter(store.slots(name, n), requires_grad=grad)
    if isinstance(getattr(module, "num_experts", None), int):
        module.num_experts = plan.num_slots  # the module now computes over K slot rows
    attach(module, layer)
    layer.module_hooks = hooks.install(module, layer)


def _restore(sub: torch.nn.Module, layer: PagedLayer) -> None:
    """Give ``sub`` its E-row parameters back (from the host rows) and its own forward."""
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


@torch.inference_mode(False)
def unwrap(module: torch.nn.Module, *, discard_slot_edits: bool = False) -> torch.nn.Module:
    """Undo ``wrap``: every paged module gets its E-row parameters back (from the host rows, on
    their original device) and its rows and slots are freed. Slot tables written in place after
    wrap (``model.parameters()`` edits reach only the K resident experts) are refused first, as
    unwrapping would drop them, unless ``discard_slot_edits=True``; host-row edits are kept."""
    check_module("unwrap", module)
    layers = [(sub, layer) for _, sub in module.named_modules() if (layer := paged_layer(sub)) is not None]
    edited = {layer.name: names for _, layer in layers if (names := layer.pager.slot_edits())}
    if edited and not discard_slot_edits:
        raise ConfigError(
            f"moepage.unwrap: slot tables written in place after wrap would be lost: {edited}. Those edits reached "
            "only the resident experts; make them in the host rows (model.state_dict() entries) instead, or call "
            "moepage.unwrap(model, discard_slot_edits=True) to drop them"
        )
    for sub, layer in layers:
        layer.pager.await_prefetch()  # no pending page-in still writes the slots we read
        _restore(sub, layer)
        layer.lifetime.release(layer.name)
    return module


def stats(module: torch.nn.Module) -> Stats:
    """Per-layer counters of every paged layer in ``module`` (read from the device: a sync), keyed by where each
    sits in ``module``: steps, waves, hits, misses, experts and bytes paged in, hit rate."""
    check_module("stats", module)
    return Stats((where, layer.read_stats()) for where, layer in named_paged_layers(module))


def host_bytes(module: torch.nn.Module) -> dict[str, HostBytes]:
    """Per paged layer of ``module`` (keyed as ``stats``): the bytes its E rows take raw and as its host store holds
    them."""
    check_module("host_bytes", module)
    return {where: layer.store.layer_bytes(layer.name) for where, layer in named_paged_layers(module)}


def named_paged_layers(module: torch.nn.Module) -> Iterable[tuple[str, PagedLayer]]:
    """``(name, layer)`` of every paged layer in ``module``: its qualified name there, or the layer's own name for
    ``module`` itself (experts modules wrapped one by one are told apart by where they sit, not by their class)."""
    for qual, sub in module.named_modules():
        layer = paged_layer(sub)
        if layer is not None:
            yield qual or layer.name, layer


def paged_layers(module: torch.nn.Module) -> Iterable[PagedLayer]:
    for _, layer in named_paged_layers(module):
        yield layer
