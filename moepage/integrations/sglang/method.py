"""The quant-method wrapper that pages one SGLang ``FusedMoE`` layer through moepage.

``PagedMoeMethod`` replaces the layer's quant method (``make_for_layer``, reached through
SGLang's own ``paged_experts.make_for_layer`` seam). It has the base method create K-row expert
tensors, redirects every per-expert checkpoint parameter's loader into a one-row view of the
host rows (SGLang's own per-expert loader does the writing: sharding, w1/w3 placement, scale
layout and parameter tags preserved), runs the post-load step as without paging
(``postload``), and serves ``apply`` through ``step.PagedExperts`` (linked to the next paged layer
for prefetch once the model is loaded: ``prefetch``) with the runner contract of
the runner the base method built (``runner``). Host rows and slots come from a moepage store
(``moepage.backends``): one per device and process, shared by all layers and released with them
(``session``).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from ..._env import env_flag
from ...errors import ConfigError
from ...pager import LayerPager, PagerOptions, can_plan_on_device, capture_mode
from ...residency import DEFAULT_POLICY, resolve_policy
from ...store import PagedExpertStore, RowSpec
from . import checks, graphs, postload, session
from .formats import expert_params, format_for
from .plugin import SPLIT_ENV, setting
from .prefetch import parse as parse_prefetch
from .runner import contract_for, runner_config, runner_of
from .session import store_for
from .sizing import auto_resident, resident_setting
from .step import PagedExperts

logger = logging.getLogger("moepage.sglang")

DEVICE_PLANNER_ENV = "MOEPAGE_DEVICE_PLANNER"  # on: also on CPU; off: never


class PagedMoeMethod(FusedMoEMethodBase, torch.nn.Module):
    """A fused-MoE method whose experts live in moepage's host rows and K-slot table.
    An ``nn.Module`` like the methods it replaces as the layer's child."""

    def __init__(
        self, base_method, fmt, name: str, num_experts: int, num_slots: int, device_planner: bool | None,
        policy: str = DEFAULT_POLICY, prefetch: bool | int = False,
    ):
        torch.nn.Module.__init__(self)
        self.policy = resolve_policy(policy)
        self.base_method = base_method
        self.format = fmt
        self.lease = session.lease(self, name)  # returned when this method is collected
        self.layer_key = self.lease.name
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.device_planner = device_planner
        self.names: tuple[str, ...] = ()  # per-expert checkpoint parameters
        self.staging: dict[str, torch.Tensor] | None = None  # checkpoint rows awaiting a repack
        self.store: PagedExpertStore | None = None
        self.moe_runner = None
        self.contract = None
        self.routed_scaling_factor = None
        self.paged: PagedExperts | None = None
        self.prefetch = prefetch  # --paged-experts-prefetch: False, True (router top_k) or m
        self.prefetch_linked = False  # set once the loaded model's layers are linked (prefetch.py)

    # -- construction -----------------------------------------------------------------------
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra):
        k = self.num_slots
        # The device tensors have K rows; loaders send all E experts to the host rows, so the
        # native global->local expert remap never sees an id >= K.
        layer.num_local_experts = k
        layer._num_local_routed = layer._num_global_routed = k
        self.native_loader = extra.get("weight_loader")
        self.base_method.create_weights(
            layer=layer, num_experts=k, hidden_size=hidden_size,
            intermediate_size_per_partition=intermediate_size_per_partition, params_dtype=params_dtype, **extra,
        )
        layer.weight_load_method = self.base_method  # loaders follow the base method's layout
        self.names = expert_params(layer, k)
        for n in self.names:
            param = getattr(layer, n)
            loader = self._host_loader(layer, n)
            if hasattr(type(param), "weight_loader") and isinstance(getattr(type(param), "weight_loader"), property):
                param._weight_loader = loader  # BasevLLMParameter: behind a read-only property
            else:
                param.weight_loader = loader

    def _host(self, n: str) -> torch.Tensor:
        if self.staging is not None:
            return self.staging[n]
        return self.store.host_rows(self.layer_key, n)

    def _host_loader(self, layer, n: str):
        def weight_loader(param, loaded_weight, weight_name, shard_id, *rest, **kwargs):
            expert_id = kwargs.pop("expert_id", rest[0] if rest else None)
            kwargs.pop("return_success", None)
            host = self._host(n)
            if expert_id is None:  # a stacked checkpoint tensor: every expert at once
                whole = torch.nn.Parameter(host, requires_grad=False)
                whole.__dict__.update(param.__dict__)
                self.native_loader(whole, loaded_weight, weight_name, shard_id, None)
                return True
            expert_id = int(expert_id)
            if not 0 <= expert_id < self.num_experts:
                return False
            row = torch.nn.Parameter(host[expert_id : expert_id + 1], requires_grad=False)
            row.__dict__.update(param.__dict__)  # the parameter's loader tags (quant_method, ...)
            layer._weight_loader_impl(
                param=row, loaded_weight=loaded_weight, weight_name=weight_name, shard_id=shard_id, expert_id=0
            )
            return True

        return weight_loader

    def create_moe_runner(self, layer, moe_runner_config):
        self.base_method.create_moe_runner(layer=layer, moe_runner_config=runner_config(moe_runner_config, self.num_slots))
        self.moe_runner = runner_of(self.base_method, layer)
        self.contract = contract_for(self.base_method, self.moe_runner)
        self.routed_scaling_factor = moe_runner_config.routed_scaling_factor
        params = {n: getattr(layer, n) for n in self.names}
        device = next(iter(params.values())).device
        self.store = self.lease.store = store_for(device)
        # SGLang builds the model under its device as the default one (``with torch.device``):
        # every tensor made here names its device. Checkpoint rows stay on the host.
        if self.contract.repacks:
            self.staging = {
                n: torch.empty((self.num_experts, *p.shape[1:]), dtype=p.dtype, device="cpu") for n, p in params.items()
            }
        else:
            specs = {n: RowSpec(tuple(p.shape[1:]), p.dtype) for n, p in params.items()}
            self.store.allocate(self.layer_key, specs, self.num_experts, self.num_slots, device)
        # What no loader writes (e.g. scales a checkpoint lacks) keeps the value the base method
        # created, as it would on the device.
        rows = torch.arange(self.num_experts, device="cpu") % self.num_slots
        for n, p in params.items():
            self._host(n).copy_(p.data.cpu()[rows])
            if self.staging is None:
                p.data = self.store.slots(self.layer_key, n)

    def process_weights_after_loading(self, layer):
        k, key, store = self.num_slots, self.layer_key, self.store
        device = getattr(layer, self.names[0]).device
        if self.staging is not None:
            def allocate(specs):
                store.allocate(key, specs, self.num_experts, k, device)
                return lambda n: store.host_rows(key, n)

            names = postload.repack(layer, self.base_method, self.staging, k, self.format.unpaged, allocate)
            self.staging = None
            for n in names:
                slots = store.slots(key, n)
                slots.copy_(store.host_rows(key, n)[:k])
                getattr(layer, n).data = slots
        else:
            names = list(self.names)
            postload.keep_layout(layer, self.base_method, names, lambda n: store.host_rows(key, n),
                                 lambda n: store.slots(key, n), k)
        specs = {n: RowSpec(tuple(store.host_rows(key, n).shape[1:]), store.host_rows(key, n).dtype) for n in names}
        options = PagerOptions(verify=env_flag("MOEPAGE_VERIFY"), device_planner=self._use_device_planner(store, device),
                               policy=self.policy)
        pager = LayerPager(key, store, specs, self.num_experts, k, options)
        self.paged = PagedExperts(pager, self.contract, self.base_method, self.routed_scaling_factor)

    def _use_device_planner(self, store, device) -> bool:
        want = self.device_planner if self.device_planner is not None else env_flag(DEVICE_PLANNER_ENV, None)
        if want is None:
            want = torch.device(device).type == "cuda" and not graphs.graphs_disabled()
        return bool(want and can_plan_on_device(store, device))

    # -- delegation --------------------------------------------------------------------------
    def get_moe_runner_backend(self, layer):
        return self.base_method.get_moe_runner_backend(layer)

    def get_moe_routing_method_type(self, layer, routing_method_type):
        return self.base_method.get_moe_routing_method_type(layer, routing_method_type)

    @property
    def runner(self):
        return self.moe_runner

    # -- forward ------------------------------------------------------------------------------
    def apply(self, layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        if self.prefetch and not self.prefetch_linked:
            raise ConfigError(
                f"layer {self.layer_key}: --paged-experts-prefetch is on but the layers were never linked: moepage "
                "links them after DefaultModelLoader.postprocess_weights, which this load did not run; "
                "pass --paged-experts-prefetch off"
            )
        topk = dispatch_output.topk_output
        if topk.topk_ids.numel() > self.num_slots and graphs.in_breakable_graph():
            # More than one wave under the breakable prefill graph: plan on the host, as an
            # eager break (a captured prefill would compute every wave over every entry).
            out = torch.empty_like(dispatch_output.hidden_states)
            self._eager_waves(layer, dispatch_output.hidden_states, topk.topk_weights, topk.topk_ids, topk.router_logits, out)
            return StandardCombineInput(hidden_states=out)
        with capture_mode(graphs.sglang_capture_mode()):
            return StandardCombineInput(hidden_states=self.paged.forward(layer, dispatch_output))

    def _eager_waves_impl(self, layer, hidden, topk_weights, topk_ids, router_logits, out) -> None:
        dispatch = graphs.standard_dispatch(hidden, topk_weights, topk_ids, router_logits)
        out.copy_(self.paged.forward(layer, dispatch))

    _eager_waves = graphs.eager_break(_eager_waves_impl)


def router_top_k(layer) -> int | None:
    if layer.top_k is not None:
        return layer.top_k
    try:  # models routing through a separate TopK module leave FusedMoE's top_k unset
        from sglang.srt.runtime_context import process_model_config

        return process_model_config().hf_text_config.num_experts_per_tok
    except Exception:
        return None


def make_for_layer(layer, base_method, device_planner: bool | None = None) -> PagedMoeMethod:
    """Check the launch and the layer, settle K, and wrap ``base_method``."""
    raw = resident_setting()
    top_k = router_top_k(layer)
    num_experts = layer.num_local_experts
    device = torch.get_default_device()  # where the layer's tensors are being created
    can_gather = None
    if graphs.decode_graphs_full():
        store = store_for(device)
        can_gather = can_plan_on_device(store, device)
    policy = setting("paged_experts_policy")
    prefetch = setting("paged_experts_prefetch")
    checks.check(layer, base_method, raw, top_k, can_gather, policy, prefetch)  # refuses K > E, as moepage.wrap does
    k = auto_resident(num_experts, top_k or 1, device) if raw == "auto" else raw
    name = getattr(layer, "layer_name", "") or f"moe.{getattr(layer, 'layer_id', 0)}"
    split = setting("paged_experts_split")
    if split:
        k = split_resident(split, k, session.next_layer_index(), name, num_experts, top_k or 1)
    return PagedMoeMethod(base_method, format_for(base_method), name, num_experts, k, device_planner,
                          policy or DEFAULT_POLICY, parse_prefetch(prefetch))


@functools.lru_cache(maxsize=8)
def _split(path: str, k: int, *version) -> dict:
    """The split file's ``{layer: K}`` for a total of ``k`` per layer, read once per model (a
    re-split runs the budget allocation), again when the file changes (``version``)."""
    from ...budgets import load_split

    return load_split(path, budget=k * len(load_split(path)))


def split_resident(path: str, k: int, index: int, name: str, num_experts: int, top_k: int) -> int:
    """This layer's K from a split file (``moepage.budgets``): the i-th MoE layer's, after the file
    is re-split to a total of ``k`` per layer when its own total differs."""
    where = f"--paged-experts-split / {SPLIT_ENV} {path!r}"
    try:
        stat = os.stat(path)
        layers = _split(path, k, stat.st_mtime_ns, stat.st_size)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    chosen = layers.get(name, layers.get(index))
    if chosen is None:
        raise ConfigError(f"{where}: no K for MoE layer {index} ({name}); the file has {len(layers)} layers")
    if not top_k <= chosen <= num_experts:
        raise ConfigError(f"{where}: K = {chosen} for layer {index} ({name}) is outside top_k={top_k}..E={num_experts}")
    logger.info("moepage: layer %s (MoE layer %d) keeps K=%d from the split %s", name, index, chosen, path)
    return chosen


def paged_methods(model: torch.nn.Module):
    """Every ``PagedMoeMethod`` in ``model``."""
    return [m for m in model.modules() if isinstance(m, PagedMoeMethod)]
