"""Every reach of moepage's vLLM plugin into vLLM 0.33.0's internals, in one place, so a vLLM release that moves one
fails here. vLLM has no hook registry and no paged experts of its own: the plugin wraps five of its functions
(``HOOKS``, installed by ``plugin.register``) and runs the base quant method's own modular kernel on the K-slot table.

A wave is the layer's kernel on the slot table with the whole batch (vLLM's workspaces are sized for it): an entry
whose expert the wave holds goes to its slot, the others to slot K, which an expert map of K + 1 entries sends
nowhere (the kernel writes zeros there and skips it). The kernel's top-k sum (``moe_sum`` of its router-weighted
per-entry outputs) is taken from it for the wave (``_taking_rows``), the wave's entries kept; the step ends with that
same sum, once, over the merged entries. The kernel's tile configuration is pinned to the one vLLM picks for the
unpaged layer (E experts, the same batch): a K-row table would otherwise key another."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from vllm.config import get_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.fused_moe import RoutedExperts, override_config
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
from vllm.model_executor.model_loader import dummy_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from ..auto import RankShare
from ..fused import W2, W13, FusedLayout
from ..rows import set_weight_loader
from .checks import Launch, Layer

__all__ = ["FusedMoEMethodBase", "set_weight_loader"]


def current_config():
    """The ``VllmConfig`` vLLM set around model construction."""
    return get_current_vllm_config()


def additional_config(vllm_config) -> object:
    return getattr(vllm_config, "additional_config", None)


def launch(vllm_config) -> Launch:
    """What the checks read of ``vllm_config``."""
    par, offload = vllm_config.parallel_config, vllm_config.offload_config
    uva, prefetch = getattr(offload, "uva", None), getattr(offload, "prefetch", None)
    offloads = [what for what, on in (("--cpu-offload-gb", getattr(uva, "cpu_offload_gb", 0)),
                                      ("--offload-group-size", getattr(prefetch, "offload_group_size", 0))) if on]
    model, load = vllm_config.model_config, vllm_config.load_config
    return Launch(
        pipeline_parallel=par.pipeline_parallel_size,
        data_parallel=par.data_parallel_size,
        eplb=bool(par.enable_eplb),
        redundant_experts=int(getattr(par.eplb_config, "num_redundant_experts", 0) or 0),
        all2all=bool(par.use_all2all),
        dbo=bool(par.enable_dbo),
        elastic_ep=bool(par.enable_elastic_ep),
        context_parallel=par.prefill_context_parallel_size * par.decode_context_parallel_size,
        lora=vllm_config.lora_config is not None,
        speculative=vllm_config.speculative_config is not None,
        offload=", ".join(offloads),
        load_format=str(getattr(load, "load_format", "auto")),
        quantization=None if model is None else model.quantization,
        sleep_mode=bool(getattr(model, "enable_sleep_mode", False)),
        architectures=tuple(getattr(model, "architectures", None) or ()),
        checkpoint=None if model is None else checkpoint_dir(model),
        cuda_graphs=graphs_enabled(vllm_config),
    )


def dummy_fill(name: str, param: torch.nn.Parameter) -> None:
    """vLLM's dummy fill of one tensor, in place: the ``initialize_single_dummy_weight`` its ``DummyModelLoader`` calls
    on each tensor of a layer, by the tensor's name (its seed per tensor, ranges by dtype, tags such as
    ``dummy_weight_value``)."""
    dummy_loader.initialize_single_dummy_weight(param, name=name)


def checkpoint_dir(model_config) -> str | None:
    """The local folder of the checkpoint's files: the model given as a folder, or a hub id's snapshot already in
    the Hugging Face cache (None where the weights are not here yet: vLLM downloads them after the layers are built)."""
    import glob
    import os

    model = str(model_config.model)
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(model, revision=getattr(model_config, "revision", None), local_files_only=True)
    except Exception:  # any miss (not cached, offline, not a hub id) means: not here
        return None
    return folder if glob.glob(os.path.join(folder, "*.safetensors")) else None


def gpu_bytes(device: torch.device) -> int | None:
    """The memory of the GPU ``device`` is (None for any other device)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def auto_sizing(vllm_config) -> tuple[str | None, float, RankShare]:
    """What ``auto`` reads of vLLM: the checkpoint's folder, ``--gpu-memory-utilization`` and this rank's share
    (TP shards attention and the vocabulary and, without EP, every expert; EP splits the experts whole)."""
    par = vllm_config.parallel_config
    tp, ep = par.tensor_parallel_size, bool(par.enable_expert_parallel)
    share = RankShare(tp_size=tp, moe_tp_size=1 if ep else tp, ep_size=tp * par.data_parallel_size if ep else 1)
    model = vllm_config.model_config
    folder = None if model is None else checkpoint_dir(model)
    return folder, float(vllm_config.cache_config.gpu_memory_utilization), share


def graphs_enabled(vllm_config) -> bool:
    """Whether vLLM captures CUDA graphs (the device planner's default)."""
    if vllm_config.model_config is not None and vllm_config.model_config.enforce_eager:
        return False
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    return mode is None or getattr(mode, "name", str(mode)) != "NONE"


def graph_mode() -> bool:
    """Whether vLLM runs this forward for a CUDA graph (its warm-ups and capture; a replay runs no Python)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return False
    mode = getattr(get_forward_context(), "cudagraph_runtime_mode", None)
    return mode is not None and getattr(mode, "name", str(mode)) != "NONE"


def _class_names(obj) -> str:
    return " ".join(c.__name__ for c in type(obj).__mro__)


def layer_facts(layer, base_method, own_quant_method: bool) -> Layer:
    """What the checks read of a ``RoutedExperts`` being built."""
    return Layer(name=layer.layer_name, num_experts=int(layer.global_num_experts),
                 local_experts=int(layer.local_num_experts), top_k=int(layer.top_k),
                 method=_class_names(base_method), dtype=layer.params_dtype, own_quant_method=own_quant_method,
                 fp8_scales=_fp8_scales(base_method), fused=_fused_layout(layer, base_method))


def _fused_layout(layer, base_method) -> FusedLayout:
    """What the layer's experts compute (``integrations.fused``): unquantized (vLLM's own unquantized method), biases,
    activation and SwiGLU settings, as its MoE config and constructor say."""
    config = layer.moe_config
    quirks = tuple(n for n in ("swiglu_limit", "swiglu_alpha", "swiglu_beta") if getattr(layer, n, None) is not None)
    params = (W13, W2) + (("w13_bias", "w2_bias") if getattr(config, "has_bias", False) else ())
    activation = getattr(layer.activation, "value", layer.activation)
    return FusedLayout(unquantized="UnquantizedFusedMoEMethod" in _class_names(base_method).split(),
                       dtype=layer.params_dtype, params=params, activation=str(activation),
                       gated=bool(config.is_act_and_mul),
                       weight_on_input=bool(layer.apply_router_weight_on_input), swiglu_quirks=quirks)


def _fp8_scales(base_method) -> str | None:
    """How an FP8 method (``Fp8MoEMethod``) scales: "block", or per-tensor static / dynamic; None if not FP8."""
    if not isinstance(base_method, Fp8MoEMethod):
        return None
    if base_method.block_quant:
        return "block"
    return f"per-tensor {base_method.quant_config.activation_scheme}"


def per_expert(layer, k: int) -> tuple[str, ...]:
    """The layer's per-expert tensors: its own parameters of K rows (weights and, where the model has them, biases)."""
    return tuple(n for n, p in layer.named_parameters(recurse=False) if p.dim() >= 1 and p.shape[0] == k
                 and p.numel() > 0)


def kernel_facts(base_method) -> tuple[str, bool, bool]:
    """(the fused-experts class and its bases, monolithic, whether its top-k sum is a separate ``moe_sum``)."""
    kernel = base_method.moe_kernel
    if kernel is None:
        return type(base_method).__name__, bool(base_method.is_monolithic), False
    fx = getattr(kernel, "fused_experts", None)
    apart = (isinstance(fx, TritonExperts) and not getattr(kernel.prepare_finalize, "supports_async", lambda: True)()
             and getattr(fx, "post_gemm2_hook", None) is None)
    return _class_names(fx), bool(kernel.is_monolithic), apart


def rank_place(layer) -> tuple[int, int]:
    """(which shard of each expert, which share of the experts) this rank holds: the layer's MoE TP and EP ranks."""
    config = layer.moe_config.moe_parallel_config
    return int(config.tp_rank), int(config.ep_rank)


def local_expert(layer, expert_id: int) -> int:
    """Checkpoint expert ``expert_id``'s id on this rank (-1: another rank's), as vLLM's loader maps it."""
    return int(layer._map_global_expert_id_to_local_expert_id(expert_id))


def local_ids(layer, topk_ids: torch.Tensor) -> torch.Tensor:
    """The routing in this rank's expert ids: vLLM routes in global ids and, under EP, maps them with the layer's
    expert map (-1 for other ranks' experts, which the paged step takes as padding)."""
    emap = layer.expert_map
    return topk_ids if emap is None else emap[topk_ids.long()].to(topk_ids.dtype)


# -- a wave on the slot table ------------------------------------------------------------------------------------
def expert_map(k: int, device: torch.device) -> torch.Tensor:
    """Slots 0..K-1 to themselves, slot K (entries outside the wave) nowhere."""
    return torch.cat([torch.arange(k, dtype=torch.int32, device=device),
                      torch.full((1,), -1, dtype=torch.int32, device=device)])


@contextlib.contextmanager
def _taking_rows(fx, take: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Inside: the experts' top-k sum hands its per-entry outputs ``[M, top_k, H]`` to ``take`` instead."""
    fx.moe_sum = lambda rows, output, topk_ids=None, expert_map=None: take(rows)
    try:
        yield
    finally:
        del fx.moe_sum


def unpaged_config(base_method, layer, num_experts: int, tokens: int, dtype: torch.dtype) -> dict | None:
    """The tile configuration vLLM's Triton experts pick for the unpaged layer (E rows) at this batch."""
    fx = base_method.moe_kernel.fused_experts
    if not isinstance(fx, TritonExperts):
        return None
    w13, w2 = layer.w13_weight, layer.w2_weight
    return try_get_optimal_moe_config((num_experts, *w13.shape[1:]), (num_experts, *w2.shape[1:]), int(layer.top_k),
                                      fx.quant_config.config_name(dtype), tokens, block_shape=fx.block_shape)


def run_wave(base_method, layer, x: torch.Tensor, topk_weights: torch.Tensor, ids: torch.Tensor,
             emap: torch.Tensor, config: dict | None, take: Callable[[torch.Tensor], None]) -> None:
    """The base kernel over the slot table for entries ``ids`` (slots, K outside the wave); outputs to ``take``."""
    kernel = base_method.moe_kernel
    pinned = override_config(config) if config is not None else contextlib.nullcontext()
    with pinned, _taking_rows(kernel.fused_experts, take):
        kernel.apply(x, layer.w13_weight, layer.w2_weight, topk_weights, ids, activation=layer.activation,
                     global_num_experts=emap.numel(), expert_map=emap,
                     apply_router_weight_on_input=layer.apply_router_weight_on_input)


def reduce(base_method, rows: torch.Tensor, out: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts' own top-k sum of the merged per-entry outputs, as the unpaged layer takes it."""
    fx = base_method.moe_kernel.fused_experts
    type(fx).moe_sum(fx, rows, out, topk_ids, None)
    return out


# -- the functions the plugin wraps -------------------------------------------------------------------------------
HOOKS = {  # name -> (owner, attribute)
    "add_cli_args": (EngineArgs, "add_cli_args"),
    "from_cli_args": (EngineArgs, "from_cli_args"),
    "create_engine_config": (EngineArgs, "create_engine_config"),
    "get_quant_method": (RoutedExperts, "_get_quant_method"),
    "load_model": (BaseModelLoader, "load_model"),
}


def own_quant_method(layer) -> bool:
    """Whether the layer's class chooses its quant method itself (the wrapped one is not asked)."""
    return type(layer)._get_quant_method is not RoutedExperts._get_quant_method


def parser_actions(parser) -> list:
    return parser._actions


def version() -> str:
    """The installed vllm's version (rows laid out by one version's loaders are reused by the same version only)."""
    from importlib.metadata import version as installed

    return installed("vllm")
