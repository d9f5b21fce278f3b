"""``PagedMoeMethod``, the quant method paging one SGLang ``FusedMoE`` layer (``make_for_layer``, through SGLang's own
``paged_experts.make_for_layer`` seam). The base method creates K-row expert tensors; each per-expert checkpoint
parameter's loader writes a one-row view of the host rows through SGLang's own per-expert loader (sharding, w1/w3
placement, scale layout, parameter tags kept); rows, slots and post-load are ``LayerRows``'; ``apply`` is
``paged_step`` with the layer's contract. Rows and slots: one store per device and process, shared (``session``).
Under SGLang's TP each rank's rows are its shard of every expert (SGLang's loader shards them); under EP they are the
rank's own experts (checkpoint ids ``first_expert ..``), and the routing arrives in local ids, -1 for other ranks'."""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from ...capture import capture_mode
from ...config import PagingConfig, Problems
from ...errors import ConfigError
from ...pager import LayerPager, can_plan_on_device
from ...residency import DEFAULT_POLICY
from ...step import paged_step
from .. import options, session
from ..fused import FusedSwiglu
from ..linking import refuse_unlinked
from ..rows import LayerRows, set_weight_loader
from ..settle import settle
from . import checks, compat
from .contracts import LayerWaves, layer_contract
from .settings import PREFETCH_WHERE, setting
from .sizing import auto_resident, rank_share

logger = logging.getLogger("moepage.sglang")


class PagedMoeMethod(FusedMoEMethodBase, torch.nn.Module):
    """An ``nn.Module`` like the method it replaces; its experts live in moepage's host rows and K-slot table."""

    def __init__(self, base_method, fmt, name: str, num_experts: int, num_slots: int, device_planner: bool | None,
                 policy: str = DEFAULT_POLICY, prefetch: bool | int = False, first_expert: int = 0,
                 global_experts: int | None = None, compress: bool = False, tier: session.DiskTier | None = None,
                 dummy: bool = False, cpu_share: float | str | None = None):
        torch.nn.Module.__init__(self)
        problems = Problems()  # the launch's checks ran already (``checks``): these are the MOEPAGE_* variables'
        self.config = PagingConfig.from_options(problems, policy=policy, device_planner=device_planner,
                                                compress=compress, cpu_share=cpu_share or "off")
        problems.raise_if_any(f"moepage: layer {name}")
        self.base_method = base_method
        self.format = fmt  # SGLang's ExpertFormat of the base method
        self.num_experts = num_experts  # this rank's routed experts (all of them without EP)
        self.first_expert = first_expert  # the checkpoint id of local expert 0
        self.global_experts = num_experts if global_experts is None else global_experts  # the router's E
        self.num_slots = num_slots
        self.rows = LayerRows(session.lease(self, name), self.config, num_experts, num_slots, compat.expert_params,
                              tier, compat.dummy_fill if dummy else None)
        self.names: tuple[str, ...] = ()  # per-expert checkpoint parameters
        self.moe_runner = None
        self.contract = None
        self.routed_scaling_factor = 1.0
        self.link = None  # the next paged layer's prefetch (prefetch.link_model)
        self.prefetch = prefetch  # --paged-experts-prefetch: False, True (router top_k) or m
        self.prefetch_linked = False  # set once the loaded model's layers are linked (prefetch.py)

    @property
    def policy(self):
        return self.config.policy

    @property
    def layer_key(self) -> str:
        return self.rows.key

    @property
    def store(self):
        return self.rows.store

    @property
    def pager(self) -> LayerPager | None:
        return self.rows.pager

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
            set_weight_loader(getattr(layer, n), self._host_loader(layer, n))

    def _host_loader(self, layer, n: str):
        # SGLang's native loaders, as its paged experts uses them; this also reports unheld experts, fills staging.
        def weight_loader(param, loaded_weight, weight_name, shard_id, *rest, **kwargs):
            expert_id = kwargs.pop("expert_id", rest[0] if rest else None)
            kwargs.pop("return_success", None)
            if self.rows.reused:  # the rows are on disk as an earlier start laid them out: nothing to write
                return expert_id is None or 0 <= int(expert_id) - self.first_expert < self.num_experts
            if expert_id is None:  # a stacked checkpoint tensor: every expert at once

                def write_all(rows):
                    whole = torch.nn.Parameter(rows, requires_grad=False)
                    whole.__dict__.update(param.__dict__)
                    self.native_loader(whole, loaded_weight, weight_name, shard_id, None)

                self.rows.load(n, None, loaded_weight, write_all)
                return True
            expert_id = int(expert_id) - self.first_expert  # checkpoint id -> this rank's local id
            if not 0 <= expert_id < self.num_experts:  # another EP rank's expert
                return False

            def write(rows):
                row = torch.nn.Parameter(rows[expert_id : expert_id + 1], requires_grad=False)
                row.__dict__.update(param.__dict__)  # the parameter's loader tags (quant_method, ...)
                compat.load_expert_row(layer, row, loaded_weight, weight_name, shard_id)

            self.rows.load(n, expert_id, loaded_weight, write)
            return True

        return weight_loader

    def create_moe_runner(self, layer, moe_runner_config):
        self.base_method.create_moe_runner(layer=layer,
                                           moe_runner_config=compat.runner_config(moe_runner_config, self.num_slots))
        self.moe_runner = compat.runner_of(self.base_method, layer)
        self.contract = layer_contract(self.base_method, self.moe_runner)
        self.routed_scaling_factor = moe_runner_config.routed_scaling_factor or 1.0
        self.rows.start({n: getattr(layer, n) for n in self.names}, self.contract.repacks)

    def process_weights_after_loading(self, layer):
        """The base post-load step as without paging, then the layer paged (``LayerRows.finish``): host rows written
        by SGLang's loaders (or, under ``--load-format dummy``, filled as its dummy loader fills the unpaged
        tensors), repacked K experts at a time (Marlin) or coded (compress)."""
        self.rows.finish(layer, self.base_method, list(self.names), graphs=not compat.graphs_disabled(),
                         unpaged=self.format.unpaged)
        if self.pager.split is not None:  # the checks refused layers whose experts the CPU does not compute
            self.pager.split.prepare(self.pager, FusedSwiglu(int(layer.w13_weight.shape[-1])))

    # -- delegation --------------------------------------------------------------------------
    def get_moe_runner_backend(self, layer):
        return self.base_method.get_moe_runner_backend(layer)

    def get_moe_routing_method_type(self, layer, routing_method_type):
        return self.base_method.get_moe_routing_method_type(layer, routing_method_type)

    @property
    def runner(self):
        """SGLang's name for its kernel dispatcher (``FusedMoE`` reads ``quant_method.runner``); moepage's own code
        calls it ``moe_runner``, ``Runner`` being moepage's contract (``moepage.contract``)."""
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

        refuse_unlinked(self, PREFETCH_WHERE, "after DefaultModelLoader.postprocess_weights",
                        "pass --paged-experts-prefetch off")
        topk = dispatch_output.topk_output
        # Steps planned on the host, never captured: a disk tier's, a split layer's.
        on_host = self.rows.tier is not None or self.config.cpu_share is not None
        if (topk.topk_ids.numel() > self.num_slots or on_host) and compat.in_breakable_graph():
            # More than one wave (or a disk tier) under a breakable graph: plan on the host, as an
            # eager break (a captured prefill would compute every wave over every entry).
            out = torch.empty_like(dispatch_output.hidden_states)
            self._eager_waves(layer, dispatch_output.hidden_states, topk.topk_weights, topk.topk_ids,
                              topk.router_logits, out)
            return StandardCombineInput(hidden_states=out)
        with capture_mode(compat.sglang_capture_mode() and not on_host):
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
    policy = setting("paged_experts_policy")
    tier = disk_tier(layer, policy)
    # Made before the checks (settled after them): a disk tier with full decode graphs is refused, and no store is made
    # for it first.
    full = compat.decode_graphs_full() and tier is None
    can_gather = can_plan_on_device(session.store_for(device), device) if full else None
    fmt = compat.format_for(layer, base_method)
    prefetch = setting("paged_experts_prefetch")
    compress = bool(setting("paged_experts_compress"))
    store = session.store_for(device) if compress and tier is None else None
    plain = None if store is None or store.compresses else store.name  # a store that codes no rows
    checks.check(layer, base_method, fmt, raw, top_k, can_gather, policy, prefetch, compress, plain)
    name = getattr(layer, "layer_name", "") or f"moe.{getattr(layer, 'layer_id', 0)}"
    settled = settle(name, num_experts, top_k or 1, raw,
                     auto=lambda: auto_resident(num_experts, top_k or 1, device, rank_share(layer)),
                     split=setting("paged_experts_split"), tier=lambda: tier, warm=setting("paged_experts_host_warm"))
    return PagedMoeMethod(base_method, fmt, name, num_experts, settled.k, device_planner, policy or DEFAULT_POLICY,
                          checks.prefetch_setting(prefetch), first_expert=first, global_experts=layer.num_experts,
                          compress=compress, tier=settled.tier, dummy=compat.dummy_load(),
                          cpu_share=checks.cpu_share_setting())


def disk_tier(layer, policy: str | None) -> session.DiskTier | None:
    """The disk tier ``--paged-experts-host-budget`` and ``--paged-experts-spill-dir`` ask for (``options.disk_tier``;
    a byte budget is shared by the MoE layers of SGLang's checkpoint)."""
    return options.disk_tier(setting("paged_experts_host_budget"), setting("paged_experts_spill_dir"),
                             policy or DEFAULT_POLICY,
                             lambda: (compat.runtime().get_model().model_path, rank_share(layer)),
                             f"sglang {compat.version()}")


def paged_methods(model: torch.nn.Module):
    """Every ``PagedMoeMethod`` in ``model``."""
    return [m for m in model.modules() if isinstance(m, PagedMoeMethod)]
