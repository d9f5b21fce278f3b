"""What ``wrap`` will page, every input checked before anything is allocated (``prepare``): the experts modules it
found, each layer's K and plan, the config, the device the slots go to, the disk tier's held rows and warm experts,
the prefetch links and, with ``cpu_share``, each layer's experts on the CPU. Problems are collected and said in one
``ConfigError`` (``config.Problems``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..backends.protocol import PagedExpertStore
from ..config import PagingConfig, Problems, compress_problem
from ..contract import CpuExpert, Runner, cpu_expert_for, diagnoses, runner_for
from ..errors import ConfigError
from ..prefetch import Predictor
from .find import DEFAULT_PARAMS, LayerPlan, as_device, dense_experts, dense_reason, find_experts, plan_layer
from .prefetch import links as prefetch_links
from .resident import slot_counts
from .sources import Load, Loader, caller_of
from .tier import TierOptions, held_rows, tier_options, warm_experts_of


@dataclass(frozen=True)
class Prepared:
    """``wrap``'s inputs, checked: ``caller`` (the call its errors name), the layers' ``plans``, the ``config``, the
    slots' ``device``, the disk ``tier`` asked for with each layer's ``held`` rows (None: no disk tier) and ``warm``
    experts, the ``predictors`` (layer i prefetches for layer i + 1) and each layer's ``cpu_experts``."""

    caller: str
    plans: list[LayerPlan]
    config: PagingConfig
    device: torch.device
    tier: TierOptions
    held: dict[str, int] | None
    warm: dict[str, list[int]] = field(default_factory=dict)
    predictors: dict[int, Predictor] = field(default_factory=dict)
    cpu_experts: dict[str, CpuExpert] = field(default_factory=dict)


def prepare(module: torch.nn.Module, resident: object, *, backend: str | PagedExpertStore | None,
            device: str | torch.device | None, params: Sequence[str] | None, num_experts: int | None,
            top_k: int | None, implementation: str | Runner | None, verify: bool | None, name: str | None,
            device_planner: bool | None, prefill_overlap: bool, policy: object, prefill_admit: int | None,
            load: Loader | None, prefetch: object, compress: bool | None, host_budget: object, spill_dir: object,
            host_warm: object, cpu_share: object) -> Prepared:
    """``wrap``'s arguments checked (its docstring says what each means); a ``ConfigError`` listing every problem."""
    caller = caller_of(load)  # from_pretrained's errors name from_pretrained
    target_device = as_device(device) if device is not None else None
    _check_arguments(params, load)
    names, targets = _targets(module, params, name, caller)
    problems = Problems()
    ks, unmatched = slot_counts(resident, names, problems)  # None: no layer's K is checked against it
    config = PagingConfig.from_options(problems, policy=policy, verify=verify, device_planner=device_planner,
                                       overlap=prefill_overlap, admit=prefill_admit, slot_counts=ks or (),
                                       compress=compress, cpu_share=cpu_share)
    plans, cpu_experts = _plan_layers(module, names, ks, targets, config, params, num_experts, top_k,
                                      implementation, load is not None, problems)
    if unmatched is not None:  # said with the layers' E and top_k, which a split file of another model may differ in
        problems.add(unmatched.text(plans))
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
    target_device = _slots_device(target_device, plans, problems)
    problems.raise_if_any(f"{caller}: cannot page this model", len(names))
    predictors = prefetch_links(prefetch, module, [(p.name, p.qual, p.module, p.num_experts, p.top_k) for p in plans])
    return Prepared(caller, plans, config, target_device, tier, held, warm, predictors, cpu_experts)


def _check_arguments(params: object, load: object) -> None:
    if isinstance(params, (str, bytes)) or (params is not None and not all(isinstance(p, str) for p in params)):
        raise ConfigError(f"params={params!r}: pass the per-expert parameters' names as a list, e.g. "
                          "params=['gate_up_proj', 'down_proj']")
    if load is not None and not callable(load):
        raise ConfigError(f"load={load!r} ({type(load).__name__}) is not callable: pass a function "
                          "load(store, {layer: {param: RowSpec}}) that fills the host rows, or leave it unset")


def _targets(module: torch.nn.Module, params: Sequence[str] | None, name: str | None, caller: str
             ) -> tuple[list[str], list[tuple[str, torch.nn.Module]]]:
    """The experts modules of ``module`` and their names, or a ``ConfigError`` saying why there are none."""
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
    return [qual or name or type(sub).__name__ for qual, sub in targets], targets


def _plan_layers(module: torch.nn.Module, names: list[str], ks: list[int] | None, targets: list, config: PagingConfig,
                 params: Sequence[str] | None, num_experts: int | None, top_k: int | None,
                 implementation: str | Runner | None, loaded: bool, problems: Problems
                 ) -> tuple[list[LayerPlan], dict[str, CpuExpert]]:
    """Each layer's plan (its problems said to ``problems``) and, with cpu_share, its experts on the CPU."""
    plans: list[LayerPlan] = []
    cpu_experts: dict[str, CpuExpert] = {}
    for layer_name, k, (qual, sub) in zip(names, ks or [None] * len(names), targets):
        where = f"{layer_name} ({type(sub).__name__})"
        plan = plan_layer(layer_name, qual, sub, module, k, params, num_experts, top_k, problems, loaded)
        try:
            runner_for(sub, implementation)  # checked now; each step asks again (the module may switch)
        except ConfigError as exc:
            problems.add(str(exc), where)
        if plan is None:
            continue
        plans.append(plan)
        if config.cpu_share is not None:
            if isinstance(found := cpu_expert_problem(sub, plan.specs), str):
                problems.add(f"cpu_share: {found}", where)
            else:
                cpu_experts[plan.name] = found
        for n, spec in plan.specs.items():
            if config.compress and (why := compress_problem(n, spec.dtype)):
                problems.add(why, where)
    return plans, cpu_experts


def _slots_device(device: torch.device | None, plans: list[LayerPlan], problems: Problems) -> torch.device | None:
    """Where the slots go: ``device``, else where every expert parameter is (one device, not meta)."""
    devices = {p.device for plan in plans for n, p in plan.module._parameters.items() if n in plan.specs}
    if device is None and len(devices) == 1:
        device = devices.pop()
    if device is None and devices:
        problems.add(f"expert parameters span devices {sorted(map(str, devices))}; pass device=")
    elif device is not None and device.type == "meta":
        problems.add("expert parameters are on the meta device; pass device= (where the slots go)")
    return device


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
