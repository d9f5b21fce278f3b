"""Every reach into SGLang's internals (private attributes, its published runtime configuration, CUDA-graph state) and
the parts of its ``paged_experts`` package moepage composes: when SGLang changes, mend this module. CUDA graphs: full
decode graphs capture every batch size (a step of more than K entries runs a fixed number of device-planned waves;
SGLang's capture-mode warm-up plans on the device too, so kernels are built before capture). Host-planned steps under
the breakable prefill graph run as an eager break (flat tensors in, output filled in place: a replay re-runs the waves
on that step's routing); during capture the routing is not computed yet, so the break's body is skipped then."""

from __future__ import annotations

import torch

# -- SGLang's own paged experts, composed where moepage does the same ------------------------------
from sglang.srt.layers.moe.paged_experts import formats as sglang_formats
from sglang.srt.layers.moe.paged_experts.runners import (  # noqa: F401
    MARLIN,
    TRITON,
    RunnerContract,
    contract_for,
    run_on_slots,
    runner_config,
    runner_of,
)


def expert_params(layer, num_slots: int) -> tuple[str, ...]:
    """The layer's per-expert tensors, as SGLang's paged experts (and EPLB) find them, less the
    empty ones (GPTQ's ``g_idx`` without act-order: nothing to page)."""
    return tuple(n for n in sglang_formats.expert_params(layer, num_slots) if getattr(layer, n).numel() > 0)


def format_for(layer, base_method):
    """SGLang's ``ExpertFormat`` of the layer's method (None: no format handles it)."""
    return sglang_formats.format_for(layer, base_method)


def picked_marlin(base_method) -> bool:
    """Whether a method that picks its runner from ``--moe-runner-backend`` (MXFP4's) picked Marlin."""
    return bool(getattr(base_method, "use_marlin", False))


# -- private attributes of a FusedMoE layer and its parameters -------------------------------------
def local_expert_range(layer) -> tuple[int, int]:
    """(first, count): this rank's routed experts are checkpoint ids first .. first + count - 1 (SGLang's EP
    placement, as ``_map_global_expert_id_to_local_expert_id`` reads it); read before ``set_local_experts``."""
    count = layer._num_local_routed
    return layer._expert_storage_rank * count, count


def set_local_experts(layer, k: int) -> None:
    """The layer computes over K local experts (the native global->local remap never sees an id >= K)."""
    layer.num_local_experts = k
    layer._num_local_routed = layer._num_global_routed = k


def load_expert_row(layer, row, loaded_weight, weight_name, shard_id) -> None:
    """SGLang's own per-expert loader (sharding, w1/w3 placement, scale layout) into one row."""
    layer._weight_loader_impl(param=row, loaded_weight=loaded_weight, weight_name=weight_name, shard_id=shard_id,
                              expert_id=0)


def fused_layout(layer, fmt):
    """What the layer computes, for the CPU's share of a split (``integrations.fused``): its format, dtype, per-expert
    tensors (biases where ``with_bias``), activation and SwiGLU settings, as its runner config says."""
    from ..fused import W2, W13, FusedLayout

    cfg = layer.moe_runner_config
    quirks = tuple(n for n in ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit", "swiglu_limit")
                   if getattr(cfg, n, None) is not None)
    params = (W13, W2) + (("w13_weight_bias", "w2_weight_bias") if getattr(layer, "with_bias", False) else ())
    return FusedLayout(unquantized=type(fmt).__name__ == "UnquantizedFormat",
                       dtype=getattr(layer, "params_dtype", None) or cfg.params_dtype, params=params,
                       activation=str(cfg.activation), gated=bool(cfg.is_gated),
                       weight_on_input=bool(cfg.apply_router_weight_on_input), swiglu_quirks=quirks)


def argparse_actions(parser) -> list:
    return parser._actions


# -- the runtime configuration SGLang publishes ----------------------------------------------------
def runtime():
    """SGLang's ``runtime_context`` module (its published server configuration)."""
    from sglang.srt import runtime_context

    return runtime_context


def parallel():
    """SGLang's published parallel layout (widths, ranks, groups)."""
    return runtime().get_parallel()


def dummy_load() -> bool:
    """Whether the launch loads dummy weights (``--load-format dummy``: SGLang's ``DummyModelLoader``)."""
    return getattr(runtime().get_model(), "load_format", None) == "dummy"


def dummy_fill(name: str, param: torch.nn.Parameter) -> None:
    """SGLang's dummy fill of one tensor, in place: the ``initialize_dummy_weights`` its ``DummyModelLoader`` calls,
    over a module holding only ``param`` as ``name`` (its seed per tensor, range, FP8 path and scale-name rules)."""
    from sglang.srt.model_loader import loader

    holder = torch.nn.Module()
    holder.register_parameter(name, param)
    loader.initialize_dummy_weights(holder)


def resident_setting():
    """The raw ``--paged-experts-num-resident`` value in effect: an int, "auto" or None."""
    value = runtime().get_exec().moe.paged_experts_num_resident
    if isinstance(value, str):
        value = value.strip().lower()
        return int(value) if value.lstrip("-").isdigit() else value
    return value


def router_top_k(layer) -> int | None:
    if layer.top_k is not None:
        return layer.top_k
    try:  # models routing through a separate TopK module leave FusedMoE's top_k unset
        return runtime().process_model_config().hf_text_config.num_experts_per_tok
    except Exception:
        return None


# -- CUDA graphs ------------------------------------------------------------------------------------
def decode_graphs_full() -> bool:
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend

    return check_cuda_graph_backend(Phase.DECODE, Backend.FULL)


def graphs_disabled() -> bool:
    from sglang.srt.model_executor.cuda_graph_config import cuda_graph_fully_disabled

    return cuda_graph_fully_disabled()


def sglang_capture_mode() -> bool:
    """Whether SGLang's graph runner warms up or captures (``model_capture_mode``) or runs a breakable prefill graph."""
    try:
        from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode
    except ImportError:  # pragma: no cover
        return False
    return bool(get_is_capture_mode())


def in_breakable_graph() -> bool:
    try:
        from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context import (
            is_in_breakable_cuda_graph,
        )
    except ImportError:  # pragma: no cover
        return False
    return bool(is_in_breakable_cuda_graph())


def _skip_during_capture(*args, **kwargs) -> None:
    return None


def eager_break(fn):
    """``fn(self, layer, hidden, topk_weights, topk_ids, router_logits, out)`` as an eager break
    of SGLang's breakable CUDA graph (a plain call outside one)."""
    try:
        from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import eager_on_graph
    except ImportError:  # pragma: no cover
        return fn
    return eager_on_graph(True, capture_stub=_skip_during_capture)(fn)


def standard_dispatch(hidden: torch.Tensor, topk_weights, topk_ids, router_logits):
    """Rebuild the dispatch output a break was captured with, from its flat tensors."""
    from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    return StandardDispatchOutput(
        hidden_states=hidden,
        hidden_states_scale=None,
        topk_output=StandardTopKOutput(topk_weights=topk_weights, topk_ids=topk_ids, router_logits=router_logits),
    )


def graph_backends():
    """(decode backend, prefill backend) of the published CUDA-graph config (None: unpublished)."""
    try:
        cfg = runtime().get_exec().graph.cuda_graph_config
    except ValueError:
        return None, None
    if cfg is None:
        return None, None
    return cfg.decode.backend, cfg.prefill.backend


def a2a_backend() -> str:
    name = str(getattr(runtime().get_exec().moe, "moe_a2a_backend", "none") or "none")
    try:  # the resolved flag, where a launcher has set it
        from sglang.srt.layers.moe.utils import get_moe_a2a_backend

        flag = get_moe_a2a_backend()
        if not flag.is_none():
            name = str(getattr(flag, "value", flag))
    except Exception:  # pragma: no cover - older/newer flag layouts
        pass
    return name


def version() -> str:
    """The installed sglang's version (rows laid out by one version's loaders are reused by the same version only)."""
    from importlib.metadata import version as installed

    return installed("sglang")
