"""``PagedMoeMethod``, the quant method paging one SGLang ``FusedMoE`` layer (``make_for_layer``, through SGLang's own
``paged_experts.make_for_layer`` seam). The base method creates K-row expert tensors; each per-expert checkpoint
parameter's loader writes a one-row view of the host rows through SGLang's own per-expert loader (sharding, w1/w3
placement, scale layout, parameter tags kept); post-load runs as without paging (``postload``); ``apply`` is
``paged_step`` with the layer's contract. Rows and slots: one store per device and process, shared (``session``).
Under SGLang's TP each rank's rows are its shard of every expert (SGLang's loader shards them); under EP they are the
rank's own experts (checkpoint ids ``first_expert ..``), and the routing arrives in local ids, -1 for other ranks'."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import replace

import torch
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from ...backends.protocol import RowSpec
from ...capture import capture_mode
from ...config import PagingConfig, Problems, split_k, use_device_planner
from ...errors import ConfigError
from ...lifetime import page_layer, plan_codes
from ...pager import LayerPager, can_plan_on_device
from ...residency import DEFAULT_POLICY
from ...step import paged_step
from .. import session
from . import checks, compat, postload
from .contracts import LayerWaves, layer_contract
from .settings import PREFETCH_WHERE, SPLIT_WHERE, setting
from .sizing import auto_resident, rank_share

logger = logging.getLogger("moepage.sglang")


class PagedMoeMethod(FusedMoEMethodBase, torch.nn.Module):
    """An ``nn.Module`` like the method it replaces; its experts live in moepage's host rows and K-slot table."""

    def __init__(self, base_method, fmt, name: str, num_experts: int, num_slots: int, device_planner: bool | None,
                 policy: str = DEFAULT_POLICY, prefetch: bool | int = False, first_expert: int = 0,
                 global_experts: int | None = None, compress: bool = False):
        torch.nn.Module.__init__(self)
        problems = Problems()  # the launch's checks ran already (``checks``): these are the MOEPAGE_* variables'
        self.config = PagingConfig.from_options(problems, policy=policy, device_planner=device_planner,
                                                compress=compress)
        problems.raise_if_any(f"moepage: layer {name}")
        self.base_method = base_method
        self.format = fmt  # SGLang's ExpertFormat of the base method
        self.lease = session.lease(self, name)  # returned when this method is collected
        self.layer_key = self.lease.name
        self.num_experts = num_experts  # this rank's routed experts (all of them without EP)
        self.first_expert = first_expert  # the checkpoint id of local expert 0
        self.global_experts = num_experts if global_experts is None else global_experts  # the router's E
        self.num_slots = num_slots
        self.names: tuple[str, ...] = ()  # per-expert checkpoint parameters
        self.staging: dict[str, torch.Tensor] | None = None  # checkpoint rows awaiting a repack or coding
        self.store = None
        self.moe_runner = None
        self.contract = None
        self.routed_scaling_factor = 1.0
        self.pager: LayerPager | None = None
        self.link = None  # the next paged layer's prefetch (prefetch.link_model)
        self.prefetch = prefetch  # --paged-experts-prefetch: False, True (router top_k) or m
        self.prefetch_linked = False  # set once the loaded model's layers are linked (prefetch.py)

    @property
    def policy(self):
        return self.config.policy

    # -- construction -----------------------------------------------------------------------
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra):
        k = self.num_slots
        compat.set_local_experts(layer, k)  # device tensors of K rows; loaders send all E to the host rows
        self.native_loader = extra.get("weight_loader")
        self.base_method.create_weights(
            layer=layer, num_experts=k, hidden_size=hidden_size,
            intermediate_size_per_partition=intermediate_size_per_partition, params_dtype=params_dtype, **extra,
        )
        layer.weight_load_method = self.base_method  # loaders follow the base method's layout
        for n in self.format.freed:
            setattr(layer, n, None)
        self.names = compat.expert_params(layer, k)
        for n in self.names:
            compat.set_weight_loader(getattr(layer, n), self._host_loader(layer, n))

    def _host(self, n: str) -> torch.Tensor:
        if self.staging is not None:
            return self.staging[n]
        if self.config.compress:  # coded rows are no tensor to write into: a reload would be lost
            raise ConfigError(f"layer {self.layer_key}: reloading weights into experts kept coded "
                              "(--paged-experts-compress / MOEPAGE_COMPRESS) is not supported; restart the server")
        return self.store.host_rows(self.layer_key, n)

    def _host_loader(self, layer, n: str):
        # SGLang's native loaders, as its paged experts uses them; this also reports unheld experts, fills staging.
        def weight_loader(param, loaded_weight, weight_name, shard_id, *rest, **kwargs):
            expert_id = kwargs.pop("expert_id", rest[0] if rest else None)
            kwargs.pop("return_success", None)
            host = self._host(n)
            if expert_id is None:  # a stacked checkpoint tensor: every expert at once
                whole = torch.nn.Parameter(host, requires_grad=False)
                whole.__dict__.update(param.__dict__)
                self.native_loader(whole, loaded_weight, weight_name, shard_id, None)
                return True
            expert_id = int(expert_id) - self.first_expert  # checkpoint id -> this rank's local id
            if not 0 <= expert_id < self.num_experts:  # another EP rank's expert
                return False
            row = torch.nn.Parameter(host[expert_id : expert_id + 1], requires_grad=False)
            row.__dict__.update(param.__dict__)  # the parameter's loader tags (quant_method, ...)
            compat.load_expert_row(layer, row, loaded_weight, weight_name, shard_id)
            return True

        return weight_loader

    def create_moe_runner(self, layer, moe_runner_config):
        self.base_method.create_moe_runner(layer=layer,
                                           moe_runner_config=compat.runner_config(moe_runner_config, self.num_slots))
        self.moe_runner = compat.runner_of(self.base_method, layer)
        self.contract = layer_contract(self.base_method, self.moe_runner)
        self.routed_scaling_factor = moe_runner_config.routed_scaling_factor or 1.0
        params = {n: getattr(layer, n) for n in self.names}
        device = next(iter(params.values())).device
        self.lease.lifetime = lifetime = session.lifetime_for(device)
        self.store = lifetime.store
        # SGLang builds the model under a default device (``with torch.device``): name it; checkpoint rows stay on host.
        if self.contract.repacks or self.config.compress:  # host rows made at post-load, from these
            self.staging = {
                n: torch.empty((self.num_experts, *p.shape[1:]), dtype=p.dtype, device="cpu") for n, p in params.items()
            }
        else:
            specs = {n: RowSpec(tuple(p.shape[1:]), p.dtype) for n, p in params.items()}
            lifetime.allocate(self.layer_key, specs, self.num_experts, self.num_slots, device)
        # What no loader writes (e.g. scales a checkpoint lacks) keeps the base method's value, as on the device.
        rows = torch.arange(self.num_experts, device="cpu") % self.num_slots
        for n, p in params.items():
            self._host(n).copy_(p.data.cpu()[rows])
            if self.staging is None:
                p.data = self.store.slots(self.layer_key, n)

    def process_weights_after_loading(self, layer):
        """The base post-load step as without paging (``postload``), then the layer paged (``lifetime.page_layer``):
        host rows written by SGLang's loaders, repacked K experts at a time (Marlin) or coded (compress)."""
        k, key, store, lifetime = self.num_slots, self.layer_key, self.store, self.lease.lifetime
        device = getattr(layer, self.names[0]).device
        config = self._planner_config(store, device)
        staged, self.staging = self.staging, None
        if self.config.compress:  # coded from the staged checkpoint rows (a tensor the code would not shrink: raw)
            specs = {n: RowSpec(tuple(rows.shape[1:]), rows.dtype) for n, rows in staged.items()}
            specs, _ = plan_codes(specs, staged, chunk=k)
            self.pager = page_layer(lifetime, key, specs, self.num_experts, k, device, config, staged)
            for n in staged:
                getattr(layer, n).data = store.slots(key, n)
            postload.keep_layout(layer, self.base_method, list(staged), staged.__getitem__,
                                 lambda n: store.slots(key, n), k)
            held = store.layer_bytes(key)  # a log line per layer: coding takes a while
            logger.info("moepage: layer %s: host rows coded, %.1f MB -> %.1f MB (%.3fx)", key, held.raw / 1e6,
                        held.held / 1e6, held.raw / max(held.held, 1))
            return
        if staged is not None:  # Marlin: the base step over the staged rows K experts at a time

            def allocate(specs):
                lifetime.allocate(key, specs, self.num_experts, k, device)
                return lambda n: store.host_rows(key, n)

            names = postload.repack(layer, self.base_method, staged, k, self.format.unpaged, allocate)
        else:
            names = list(self.names)
            postload.keep_layout(layer, self.base_method, names, lambda n: store.host_rows(key, n),
                                 lambda n: store.slots(key, n), k)
        specs = {n: RowSpec(tuple(store.host_rows(key, n).shape[1:]), store.host_rows(key, n).dtype) for n in names}
        self.pager = page_layer(lifetime, key, specs, self.num_experts, k, device, config)
        for n in names:
            getattr(layer, n).data = store.slots(key, n)

    def _planner_config(self, store, device) -> PagingConfig:
        """The device planner: the method's choice, else ``MOEPAGE_DEVICE_PLANNER`` (on: also on
        CPU), else on for CUDA slots unless CUDA graphs are off."""
        want = self.config.device_planner  # the method's, else MOEPAGE_DEVICE_PLANNER (PagingConfig.from_options)
        if want is None:
            want = torch.device(device).type == "cuda" and not compat.graphs_disabled()
        chosen = use_device_planner(bool(want), can_plan_on_device(store, device), torch.device(device).type)
        return replace(self.config, device_planner=chosen)

    # -- delegation --------------------------------------------------------------------------
    def get_moe_runner_backend(self, layer):
        return self.base_method.get_moe_runner_backend(layer)

    def get_moe_routing_method_type(self, layer, routing_method_type):
        return self.base_method.get_moe_routing_method_type(layer, routing_method_type)

    @property
    def runner(self):
        return self.moe_runner

    # -- forward ------------------------------------------------------------------------------
    def step(self, layer, dispatch_output) -> torch.Tensor:
        """One paged step of the layer (``moepage.step.paged_step``)."""
        topk_ids = dispatch_output.topk_output.topk_ids
        if min(topk_ids.shape[1], self.num_experts) > self.num_slots:  # a token's local experts must fit the slots
            raise ConfigError(f"layer {self.layer_key}: top_k={topk_ids.shape[1]} exceeds "
                              f"--paged-experts-num-resident={self.num_slots}")
        waves = LayerWaves(self.contract, self.format.runner_method(self.base_method), layer, dispatch_output,
                           self.routed_scaling_factor)
        hook = None if self.link is None else self.link.after_page_in(dispatch_output.hidden_states)
        return paged_step(self.pager, topk_ids, waves, hook)

    def apply(self, layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        if self.prefetch and not self.prefetch_linked:
            raise ConfigError(
                f"layer {self.layer_key}: {PREFETCH_WHERE} is on but the layers were never linked: moepage "
                "links them after DefaultModelLoader.postprocess_weights, which this load did not run; "
                "pass --paged-experts-prefetch off"
            )
        topk = dispatch_output.topk_output
        if topk.topk_ids.numel() > self.num_slots and compat.in_breakable_graph():
            # More than one wave under the breakable prefill graph: plan on the host, as an
            # eager break (a captured prefill would compute every wave over every entry).
            out = torch.empty_like(dispatch_output.hidden_states)
            self._eager_waves(layer, dispatch_output.hidden_states, topk.topk_weights, topk.topk_ids,
                              topk.router_logits, out)
            return StandardCombineInput(hidden_states=out)
        with capture_mode(compat.sglang_capture_mode()):
            return StandardCombineInput(hidden_states=self.step(layer, dispatch_output))

    def _eager_waves_impl(self, layer, hidden, topk_weights, topk_ids, router_logits, out) -> None:
        out.copy_(self.step(layer, compat.standard_dispatch(hidden, topk_weights, topk_ids, router_logits)))

    _eager_waves = compat.eager_break(_eager_waves_impl)


def make_for_layer(layer, base_method, device_planner: bool | None = None) -> PagedMoeMethod:
    """Check the launch and the layer, settle K, and wrap ``base_method``."""
    raw = compat.resident_setting()
    top_k = compat.router_top_k(layer)
    num_experts = layer.num_local_experts  # E / ep_size under EP: each rank pages its own experts
    first, _ = compat.local_expert_range(layer)
    device = torch.get_default_device()  # where the layer's tensors are being created
    can_gather = can_plan_on_device(session.store_for(device), device) if compat.decode_graphs_full() else None
    fmt = compat.format_for(layer, base_method)
    policy, prefetch = setting("paged_experts_policy"), setting("paged_experts_prefetch")
    compress = bool(setting("paged_experts_compress"))
    store = session.store_for(device) if compress else None
    plain = None if store is None or store.compresses else store.name  # a store that codes no rows
    checks.check(layer, base_method, fmt, raw, top_k, can_gather, policy, prefetch, compress, plain)
    k = auto_resident(num_experts, top_k or 1, device, rank_share(layer)) if raw == "auto" else raw
    name = getattr(layer, "layer_name", "") or f"moe.{getattr(layer, 'layer_id', 0)}"
    split = setting("paged_experts_split")
    if split:
        k = split_resident(split, k, session.next_layer_index(), name, num_experts, min(top_k or 1, num_experts))
    return PagedMoeMethod(base_method, fmt, name, num_experts, k, device_planner, policy or DEFAULT_POLICY,
                          checks.prefetch_setting(prefetch), first_expert=first, global_experts=layer.num_experts,
                          compress=compress)


@functools.lru_cache(maxsize=8)
def _split(path: str, k: int, *version) -> dict:
    """The split file's ``{layer: K}`` for a total of ``k`` per layer, read once per model (a
    re-split runs the budget allocation), again when the file changes (``version``)."""
    from ...planning.budgets import load_split

    return load_split(path, budget=k * len(load_split(path)))


def split_resident(path: str, k: int, index: int, name: str, num_experts: int, top_k: int) -> int:
    """This layer's K from a split file: the i-th MoE layer's, after the file is re-split to a
    total of ``k`` per layer when its own total differs."""
    from ...config import k_problem

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


def paged_methods(model: torch.nn.Module):
    """Every ``PagedMoeMethod`` in ``model``."""
    return [m for m in model.modules() if isinstance(m, PagedMoeMethod)]
