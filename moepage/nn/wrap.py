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
from ..config import device_planner_problem, env, listed
from ..contract import Runner
from ..errors import ConfigError
from ..lifetime import Lifetime, page_layer, plan_codes
from ..pager import LayerPager, can_plan_on_device
from ..prefetch import Predictor, PrefetchLink
from ..progress import progress
from ..residency import Policy
from ..telemetry import Stats
from . import hooks
from .find import LayerPlan, check_module
from .layer import PagedLayer, attach, paged_layer
from .prepare import Prepared, prepare
from .sources import Loader, coded_rows_said, layer_sources, shows_progress


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
      experts modules), or a split file from ``moepage plan --trace T --budget N --out F`` (a string is
      always its path: K is an int).
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
      off (default; 0 or 0.0 too; ``MOEPAGE_CPU_SHARE``). Not bit-exact: the CPU's GEMMs round differently
      (docs/cpu-split.md). Steps are then planned on the host; a CUDA graph capture is refused.
    """
    check_module("wrap", module)
    ready = prepare(module, resident, backend=backend, device=device, params=params, num_experts=num_experts,
                    top_k=top_k, implementation=implementation, verify=verify, name=name,
                    device_planner=device_planner, prefill_overlap=prefill_overlap, policy=policy,
                    prefill_admit=prefill_admit, load=load, prefetch=prefetch, compress=compress,
                    host_budget=host_budget, spill_dir=spill_dir, host_warm=host_warm, cpu_share=cpu_share)
    lifetime = _lifetime(ready, backend)
    done: list[torch.nn.Module] = []
    try:
        raw = _page_layers(ready, lifetime, load, implementation, done)
        for layer_name, experts in ready.warm.items():  # a trace's most used experts: the host tiers start with them
            lifetime.store.warm(layer_name, experts)
        for i, predictor in ready.predictors.items():  # layer i prefetches for layer i + 1
            plans = ready.plans
            paged_layer(plans[i].module).prefetch = PrefetchLink(paged_layer(plans[i + 1].module).pager, predictor)
    except BaseException:
        for sub in reversed(done):
            _restore(sub, paged_layer(sub))
        lifetime.rollback()
        raise
    if raw:
        warnings.warn(f"{ready.caller}: compress=True keeps {len(raw)} expert tensor(s) raw: {listed(raw, 4, '; ')}",
                      stacklevel=2)
    if device is not None and module not in done:
        module.to(ready.device)
    return module


def _lifetime(ready: Prepared, backend: str | PagedExpertStore | None) -> Lifetime:
    """The store the prepared layers page through (a tiered one over a disk tier), owned unless the caller gave it."""
    device, config = ready.device, ready.config
    if ready.held is None:
        store = backends.resolve(backend if backend is not None else env("MOEPAGE_BACKEND"), device)
    else:
        store = backends.tiered_store(ready.tier.spill_dir, ready.held, device, backend or env("MOEPAGE_BACKEND"),
                                      config.policy)
    lifetime = Lifetime(store, owns_store=not isinstance(backend, PagedExpertStore))
    if why := device_planner_problem(config.device_planner, can_plan_on_device(store, device), store.name, device):
        lifetime.rollback()
        raise ConfigError(f"{ready.caller}: {why}")
    return lifetime


def _page_layers(ready: Prepared, lifetime: Lifetime, load: Loader | None, implementation: str | Runner | None,
                 done: list[torch.nn.Module]) -> list[str]:
    """Page every prepared layer through ``lifetime`` (each module appended to ``done`` once attached); returns the
    tensors compress=True keeps raw, and why."""
    config, device, plans = ready.config, ready.device, ready.plans
    raw: list[str] = []
    coded = 0  # layers coded here (none where an earlier load's coded rows are reused)
    with layer_sources(plans, lifetime, load, device, config.compress) as sources:
        # Coding shows a bar (where tqdm is, on a terminal or as the call asked); plain copies are quick.
        with progress(shows_progress(load) if config.compress else False, "coding host rows", "layer") as tick:
            for plan, rows in sources:
                specs = plan.specs
                if config.compress and rows is not None:
                    specs, why = plan_codes(specs, rows, chunk=plan.num_slots, device=device)
                    raw += [f"{plan.name}.{n}: {reason}" for n, reason in why.items()]
                pager = page_layer(lifetime, plan.name, specs, plan.num_experts, plan.num_slots, device, config, rows)
                _attach(plan, pager, lifetime, implementation, preloaded=load is not None,
                        on_disk=ready.held is not None)
                done.append(plan.module)
                if pager.split is not None:  # checked against the module on its device, its costs measured
                    pager.split.prepare(pager, ready.cpu_experts[plan.name], paged_layer(plan.module).on_device)
                if tick is not None and rows is not None:  # (coded rows kept by an earlier load: none coded)
                    coded += 1
                    tick(coded, len(plans))
            if tick is not None and (said := coded_rows_said(lifetime.store, coded)) is not None:
                # After the last layer (its coded layout kept); reused, every layer's coded rows are ready, none coded.
                tick(len(plans), len(plans), note=said, title=None if coded else "coded host rows")
    return raw


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
