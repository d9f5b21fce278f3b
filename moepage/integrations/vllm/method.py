"""``PagedVllmMethod``, the quant method paging one vLLM ``RoutedExperts`` layer (the plugin's wrap of
``RoutedExperts._get_quant_method``). The base method creates the expert tensors with K rows, which become the slot
table; each one's loader is vLLM's own, handed a parameter over all E host rows (checkpoint ids, w1/w3 placement and
sharding as without paging); under ``--load-format dummy`` the rows are filled at post-load as vLLM's dummy loader fills
the unpaged tensors (``LayerRows``). Post-load runs as without paging; ``apply`` is ``paged_step`` with
``VllmWaves``: each wave the base kernel over the slot table (``compat.run_wave``), the step ending in that kernel's
own top-k sum. Rows and slots: one store per device and process, shared (``session``)."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from ...capture import capture_mode
from ...config import PagingConfig, Problems, parse_prefetch
from ...errors import ConfigError
from ...pager import LayerPager
from ...prefetch import PrefetchLink
from ...residency import DEFAULT_POLICY
from ...step import StepWave, paged_step
from .. import session
from ..auto import resident
from ..fused import FusedSwiglu
from ..linking import refuse_unlinked
from ..options import disk_tier
from ..rows import LayerRows
from ..settle import settle
from . import checks, compat
from .settings import OPTIONS, options, setting

logger = logging.getLogger("moepage.vllm")


class VllmWaves:
    """One paged step of a vLLM layer (a ``moepage.step.StepComputation``): waves through the base kernel, merged."""

    direct = False  # the kernel's own sum ends the step, one wave or many

    def __init__(self, method: PagedVllmMethod, layer, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor):
        self.method, self.layer, self.x = method, layer, x
        self.topk_weights, self.topk_ids = topk_weights, topk_ids
        k = method.num_slots
        self.emap = method.expert_map(x.device)
        self.config = compat.unpaged_config(method.base_method, layer, method.num_experts, x.shape[0], x.dtype)
        self.k = k
        self.merged: torch.Tensor | None = None

    def run(self, wave: StepWave) -> None:
        served = wave.slots >= 0
        ids = torch.where(served, wave.slots, self.k).to(self.topk_ids.dtype)

        def take(rows: torch.Tensor) -> None:  # the kernel's workspace: keep this wave's entries now
            if self.merged is None:
                self.merged = torch.where(served.unsqueeze(-1), rows, rows.new_zeros(()))
            else:
                torch.where(served.unsqueeze(-1), rows, self.merged, out=self.merged)

        compat.run_wave(self.method.base_method, self.layer, self.x, self.topk_weights, ids, self.emap, self.config,
                        take)

    @property
    def hidden(self) -> torch.Tensor:
        return self.x

    def join(self, entries: torch.Tensor, out: torch.Tensor) -> None:
        """The CPU's entries (``split.SplitComputation``), router-weighted as the kernel keeps its entries, in the
        merged entries' dtype."""
        if self.merged is None:  # no wave ran: every routed entry is the CPU's
            self.merged = self.x.new_zeros(*self.topk_ids.shape, self.x.shape[-1])
        rows = entries.to(self.x.device)
        w = self.topk_weights.reshape(-1)[rows].float().unsqueeze(-1)
        flat = self.merged.view(-1, self.merged.shape[-1])
        flat[rows, : out.shape[-1]] = (out.to(self.x.device) * w).to(flat.dtype)

    def finish(self) -> torch.Tensor:
        merged = self.merged
        if merged is None:  # nothing routed
            merged = self.x.new_zeros(*self.topk_ids.shape, self.x.shape[-1])
        return compat.reduce(self.method.base_method, merged, torch.empty_like(self.x), self.topk_ids)


def _delegated(name: str) -> property:
    """A property read from the base method as it is."""
    return property(lambda self: getattr(self.base_method, name), doc=f"The base method's ``{name}``.")


class PagedVllmMethod(compat.FusedMoEMethodBase):
    """A vLLM MoE quant method whose experts live in moepage's host rows and K-slot table."""

    def __init__(self, base_method, name: str, num_experts: int, num_slots: int, config: PagingConfig, graphs: bool,
                 *, global_experts: int | None = None, top_k: int = 1, prefetch: bool | int = False,
                 tier: session.DiskTier | None = None, dummy: bool = False):
        super().__init__(base_method.moe)
        self.base_method = base_method
        self.num_experts, self.num_slots = num_experts, num_slots
        self.global_experts, self.top_k = global_experts or num_experts, top_k  # the router's E and top_k
        self.config, self.graphs = config, graphs
        self.prefetch, self.prefetch_linked = prefetch, False  # next-layer prefetch, linked after the load
        self.link: PrefetchLink | None = None
        self.rows = LayerRows(session.lease(self, name), config, num_experts, num_slots, compat.per_expert, tier,
                              compat.dummy_fill if dummy else None)
        self.names: tuple[str, ...] = ()
        self._emap: dict[torch.device, torch.Tensor] = {}

    @property
    def layer_key(self) -> str:
        return self.rows.key

    @property
    def pager(self) -> LayerPager | None:
        return self.rows.pager

    def expert_map(self, device: torch.device) -> torch.Tensor:
        """The wave's expert map, made once (a CUDA graph captures its address)."""
        if device not in self._emap:
            self._emap[device] = compat.expert_map(self.num_slots, device)
        return self._emap[device]

    # -- construction -----------------------------------------------------------------------------------------
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra):
        native = extra["weight_loader"]
        self.base_method.create_weights(layer, self.num_slots, hidden_size, intermediate_size_per_partition,
                                        params_dtype, **extra)
        self.names = compat.per_expert(layer, self.num_slots)
        self.rows.start({n: getattr(layer, n) for n in self.names}, repacks=False)
        for n in self.names:
            compat.set_weight_loader(getattr(layer, n), self._host_loader(layer, n, native))

    def _host_loader(self, layer, n: str, native):
        """vLLM's own loader, over a parameter of all E host rows (its tags copied): it maps checkpoint ids, places
        w1 and w3 and shards as without paging. vLLM calls it with keywords, some model loaders positionally."""

        def weight_loader(param, loaded_weight, weight_name, shard_id, expert_id=None, return_success=False):
            if self.rows.reused:  # the rows are on disk as an earlier start laid them out (one rank: all are its own)
                return True if return_success else None

            def write(rows):
                host = torch.nn.Parameter(rows, requires_grad=False)
                host.__dict__.update({k: v for k, v in param.__dict__.items() if k not in ("weight_loader",
                                                                                           "_weight_loader")})
                return native(host, loaded_weight, weight_name, shard_id, expert_id, return_success)

            local = None if expert_id is None else compat.local_expert(layer, int(expert_id))
            if local is not None and local < 0:  # another EP rank's: vLLM's loader writes nothing
                return write(self.rows.host(n))
            return self.rows.load(n, local, loaded_weight, write)

        return weight_loader

    def process_weights_after_loading(self, layer):
        self.rows.finish(layer, self.base_method, list(self.names), graphs=self.graphs)
        self.moe_kernel, self.moe_quant_config = self.base_method.moe_kernel, self.base_method.moe_quant_config
        checks.kernel_problems(self.layer_key, *compat.kernel_facts(self.base_method))
        if self.pager.split is not None:  # the checks refused layers whose experts the CPU does not compute
            self.pager.split.prepare(self.pager, FusedSwiglu(int(layer.w13_weight.shape[-1])))

    # -- delegation --------------------------------------------------------------------------------------------
    def get_fused_moe_quant_config(self, layer):
        return self.base_method.get_fused_moe_quant_config(layer)

    def maybe_roundup_sizes(self, *args, **kwargs):
        return self.base_method.maybe_roundup_sizes(*args, **kwargs)

    is_monolithic = _delegated("is_monolithic")
    topk_indices_dtype = _delegated("topk_indices_dtype")
    skip_forward_padding = _delegated("skip_forward_padding")
    has_unpadded_output = _delegated("has_unpadded_output")
    supports_internal_mk = _delegated("supports_internal_mk")

    @property
    def mk_can_overlap_shared_experts(self) -> bool:
        return False  # the waves run without shared experts; the runner runs them

    # -- forward -----------------------------------------------------------------------------------------------
    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        if self.pager is None:
            raise ConfigError(f"layer {self.layer_key}: run before its weights were loaded and processed")
        if self.base_method.moe_quant_config is None:
            self.base_method.moe_quant_config = self.moe_quant_config
        refuse_unlinked(self, OPTIONS["prefetch"].flag, "when vLLM's BaseModelLoader.load_model returns",
                        "serve with prefetch off")
        waves = VllmWaves(self, layer, x, topk_weights, topk_ids)
        local = compat.local_ids(layer, topk_ids)  # under EP: this rank's ids, -1 for other ranks' experts
        hook = None if self.link is None else self.link.after_page_in(x)
        with capture_mode(compat.graph_mode()):
            return paged_step(self.pager, local, waves, hook)


def make(layer, base_method):
    """Check the launch and the layer, settle K and wrap ``base_method`` (the wrapped ``_get_quant_method``), or
    return it unchanged where paging is off."""
    vllm_config = compat.current_config()
    chosen = options(compat.additional_config(vllm_config))
    if not chosen:
        return base_method
    facts = compat.layer_facts(layer, base_method, compat.own_quant_method(layer))
    split = setting(chosen, "split")
    k = chosen.get("num_resident")
    launch = compat.launch(vllm_config)
    checks.check(launch, chosen, facts, None if split or k == "auto" else k)
    local = facts.local_experts  # E / EP size under EP: each rank pages its own experts
    settled = settle(facts.name, local, facts.top_k, k, auto=lambda: _auto_resident(vllm_config, local, facts.top_k),
                     split=split, tier=lambda: _disk_tier(vllm_config, chosen, compat.rank_place(layer)),
                     warm=setting(chosen, "host_warm"))
    problems = Problems()
    config = PagingConfig.from_options(problems, policy=setting(chosen, "policy") or DEFAULT_POLICY,
                                       compress=bool(setting(chosen, "compress")),
                                       cpu_share=checks.cpu_share(chosen) or "off")
    problems.raise_if_any(f"moepage: layer {facts.name}")
    logger.info("moepage: layer %s pages %d experts through %d slots", facts.name, local, settled.k)
    return PagedVllmMethod(base_method, facts.name, local, settled.k, config, compat.graphs_enabled(vllm_config),
                           global_experts=facts.num_experts, top_k=facts.top_k,
                           prefetch=parse_prefetch(chosen.get("prefetch")), tier=settled.tier,
                           dummy=launch.load_format == "dummy")


def _disk_tier(vllm_config, chosen: dict, place: tuple[int, int]) -> session.DiskTier | None:
    """The disk tier the host budget and spill folder ask for (``options.disk_tier``; a byte budget is shared by the
    MoE layers of the checkpoint's folder; ``place``: this rank's MoE TP and EP ranks, naming its rows)."""
    def checkpoint():
        path, _, share = compat.auto_sizing(vllm_config)
        return path, replace(share, moe_tp_rank=place[0], ep_rank=place[1])

    return disk_tier(setting(chosen, "host_budget"), setting(chosen, "spill_dir"),
                     setting(chosen, "policy") or DEFAULT_POLICY, checkpoint, f"vllm {compat.version()}")


def _auto_resident(vllm_config, num_experts: int, top_k: int) -> int:
    """K for ``auto`` on this rank, from its GPU (where vLLM builds the layer) and ``--gpu-memory-utilization``."""
    device = torch.get_default_device()
    gpu = compat.gpu_bytes(device)
    if gpu is None:
        raise ConfigError(f"moepage: {OPTIONS['num_resident'].flag} auto needs a CUDA device to size against "
                          f"(the layer is built on {device}); pass an integer K")
    path, fraction, share = compat.auto_sizing(vllm_config)
    if path is None:  # the launch check refuses this first; a worker on another machine may still lack the files
        raise ConfigError(f"moepage: {OPTIONS['num_resident'].flag} auto: the checkpoint's files are not on "
                          "this machine; pass an integer K")
    return resident(path, num_experts, top_k, gpu, fraction, share, fraction_flag="--gpu-memory-utilization",
                    logger=logger)


def paged_methods(model: torch.nn.Module) -> list[PagedVllmMethod]:
    """Every ``PagedVllmMethod`` in ``model``."""
    return [m.quant_method for m in model.modules() if isinstance(getattr(m, "quant_method", None), PagedVllmMethod)]
