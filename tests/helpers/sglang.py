"""Helpers of the SGLang integration tests: a world-size-1 SGLang process with the moepage plugin
hooked in, tiny random Hugging Face checkpoints (Qwen3-MoE, Mixtral) saved as safetensors, real
SGLang model classes built and loaded from them through SGLang's own loader, and routing that
forces a given number of waves.

Only the MoE layers are exercised. SGLang builds its rotary embedding from ``vllm`` on a machine
that is neither CUDA nor its CPU engine; ``build_model`` flags the rotary module as CPU while the
model is constructed so the attention layers can be built (they are never run).
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile

import torch

E, TOP_K, HIDDEN, INTER = 8, 2, 32, 16
K = 3  # slots per layer in most tests: E = 8, top_k = 2
FMT_E, FMT_H, FMT_I, GROUP = 8, 64, 32, 16  # the quantized layers' shapes
KINDS = ("qwen3_moe", "mixtral")
_CKPTS: dict[tuple, str] = {}
_READY = False


def setup_sglang() -> None:
    """World-size-1 gloo process groups + the moepage plugin's hooks, once per process."""
    global _READY
    if _READY:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.test.layer_ut_utils import init_single_process_dist

    import moepage.integrations.sglang as plugin

    init_single_process_dist(master_port=29000 + os.getpid() % 2000)
    plugin.register()
    HookRegistry.apply_hooks()
    # SGLang keeps the exception of an optional import it caught (deep_ep), whose traceback
    # holds every frame live at that first import: import here, so that no test's frames (and
    # the models in them) are kept alive by it.
    for kind in KINDS:
        model_class(kind)
    _READY = True


def hf_config(kind: str):
    common = dict(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, num_experts_per_tok=TOP_K)
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=INTER, num_experts=E,
                              decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, **common)
    from transformers import MixtralConfig

    return MixtralConfig(intermediate_size=INTER, num_local_experts=E, **common)


def checkpoint(kind: str, dtype: torch.dtype) -> str:
    """A tiny random checkpoint of ``kind`` in ``dtype`` (saved once per process)."""
    key = (kind, dtype)
    if key not in _CKPTS:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(hash(key) % 1000)
        model = AutoModelForCausalLM.from_config(hf_config(kind)).to(dtype)
        with torch.no_grad():  # HF initialises some weights at exactly zero: make every row count
            for p in model.parameters():
                p.normal_(0, 0.5)
        path = tempfile.mkdtemp(prefix=f"moepage-{kind}-")
        model.save_pretrained(path)
        _CKPTS[key] = path
    return _CKPTS[key]


def checkpoint_weights(path: str):
    from safetensors import safe_open

    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)


@contextlib.contextmanager
def server_args(**fields):
    """Publish a dummy SGLang config with ``fields`` for the duration of the block."""
    from sglang.srt.runtime_context import get_context

    with get_context().override_server_args(**fields) as record:
        yield record


def model_class(kind: str):
    if kind == "qwen3_moe":
        from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM
    if kind == "gpt_oss":
        from sglang.srt.models.gpt_oss import GptOssForCausalLM

        return GptOssForCausalLM
    from sglang.srt.models.mixtral import MixtralForCausalLM

    return MixtralForCausalLM


def construct(kind: str, config, dtype: torch.dtype, quant_config=None):
    """The SGLang model class of ``kind`` built from ``config`` (a transformers config), unloaded."""
    import sglang.srt.layers.rotary_embedding.base as rope
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    saved = rope._is_cpu
    rope._is_cpu = True
    try:
        with set_default_torch_dtype(dtype):
            return model_class(kind)(config, quant_config=quant_config)
    finally:
        rope._is_cpu = saved


def build_model(kind: str, dtype: torch.dtype, quant_config=None, stored: torch.dtype | None = None):
    """The SGLang model class of ``kind`` built under the published config and loaded from the
    tiny checkpoint (in ``stored``, else ``dtype``) through SGLang's ``DefaultModelLoader`` (loaders + post-load
    steps)."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    model = construct(kind, hf_config(kind), dtype, quant_config)
    path = checkpoint(kind, stored or dtype)
    DefaultModelLoader.load_weights_and_postprocess(model, checkpoint_weights(path), torch.device("cpu"))
    return model


def moe_layers(model):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def routing(rng: random.Random, tokens: int, num_distinct: int, top_k: int = TOP_K, e: int = E):
    """``[tokens, top_k]`` int32 ids, distinct per token, covering exactly ``num_distinct`` experts."""
    from helpers.routing import draw_routing  # the suite's one routing generator

    ids, _, _ = draw_routing(rng, tokens, top_k, e, pool=rng.sample(range(e), num_distinct))
    return ids.to(torch.int32)


def topk_output(ids: torch.Tensor, seed: int = 0, e: int = E):
    """A routing as SGLang's TopK gives it: normalised weights, the ids, and router logits ``[T, E]``
    (the Marlin runner checks their shape)."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    g = torch.Generator().manual_seed(seed)
    w = torch.rand(ids.shape, generator=g)
    w = w / w.sum(dim=1, keepdim=True)
    logits = torch.randn(ids.shape[0], e, generator=g)
    return StandardTopKOutput(topk_weights=w, topk_ids=ids, router_logits=logits)


# -- builders shared by the SGLang tests -------------------------------------------------------------
def paged_args(k=K, **more):
    return dict(enable_paged_experts=True, paged_experts_num_resident=k, **more)


def build_pair(kind, dtype, k=K, quant_config=None, stored=None, **more):
    with server_args():
        ref = build_model(kind, dtype, quant_config, stored)
    with server_args(**paged_args(k, **more)):
        paged = build_model(kind, dtype, quant_config, stored)
    return ref, paged


def forward(layer, x, topk):
    with server_args():
        return layer(x, topk)

def bare_layer(shared=0, quant_config=None, top_k=TOP_K, dtype=torch.bfloat16):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    with set_default_torch_dtype(dtype):
        return FusedMoE(num_experts=E + shared, hidden_size=64, intermediate_size=32, layer_id=0, top_k=top_k,
                        prefix="model.layers.0.mlp.experts", num_fused_shared_experts=shared, quant_config=quant_config)


def graph_config(decode="disabled", prefill="disabled", bs=None):
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig
    from sglang.srt.runtime_context import get_context

    cfg = CudaGraphConfig(decode=PhaseConfig(backend=decode, bs=bs, max_bs=max(bs) if bs else None),
                          prefill=PhaseConfig(backend=prefill))
    get_context().override("moepage-test", cuda_graph_config=cfg)
    return cfg


def fp8_config(block=(16, 16)):
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    return Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                     weight_block_size=list(block) if block else None)

def load_experts(layer, ckpt: dict) -> None:
    """Feed checkpoint tensors through SGLang's expert mapping and the parameters' real weight
    loaders, as a model's ``load_weights`` does."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    mapping = FusedMoE.make_expert_params_mapping(
        ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj", ckpt_up_proj_name="up_proj",
        num_experts=FMT_E,
    )
    prefix = "model.layers.0.mlp.experts"
    params = dict(layer.named_parameters(prefix=prefix))
    for name, tensor in ckpt.items():
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name in name:
                target = name.replace(weight_name, param_name)
                param = params[target]
                param.weight_loader(param, tensor, target, shard_id=shard_id, expert_id=expert_id)
                break
        else:
            raise KeyError(name)


def fp8_block_checkpoint(seed=0):
    g = torch.Generator().manual_seed(seed)
    ckpt = {}
    for e in range(FMT_E):
        for proj, shape in (("gate_proj", (FMT_I, FMT_H)), ("up_proj", (FMT_I, FMT_H)), ("down_proj", (FMT_H, FMT_I))):
            pre = f"model.layers.0.mlp.experts.{e}.{proj}."
            ckpt[pre + "weight"] = torch.randn(shape, generator=g).to(torch.float8_e4m3fn)
            ckpt[pre + "weight_scale_inv"] = torch.rand((shape[0] // 16, shape[1] // 16), generator=g)
    return ckpt


def gptq_checkpoint(bits: int, seed=0):
    g = torch.Generator().manual_seed(seed)
    pack = 32 // bits
    ckpt = {}
    for e in range(FMT_E):
        for proj, (inp, out) in (("gate_proj", (FMT_H, FMT_I)), ("up_proj", (FMT_H, FMT_I)),
                                 ("down_proj", (FMT_I, FMT_H))):
            pre = f"model.layers.0.mlp.experts.{e}.{proj}."
            ckpt[pre + "qweight"] = torch.randint(-2**31, 2**31 - 1, (inp // pack, out), dtype=torch.int32, generator=g)
            ckpt[pre + "scales"] = torch.rand((inp // GROUP, out), generator=g).half()
            ckpt[pre + "qzeros"] = torch.randint(-2**31, 2**31 - 1, (inp // GROUP, out // pack), dtype=torch.int32,
                                                 generator=g)
            ckpt[pre + "g_idx"] = (torch.arange(inp) // GROUP).int()
    return ckpt


def gptq_config(bits: int):
    from sglang.srt.layers.quantization.gptq.gptq import GPTQMarlinConfig

    return GPTQMarlinConfig.from_config(
        {"bits": bits, "group_size": GROUP, "desc_act": False, "sym": True, "lm_head": False, "quant_method": "gptq"}
    )


@contextlib.contextmanager
def admitted(*formats: str, fp8_blocks=((16, 16),)):
    """Serve formats (``checks.SERVED`` names) and FP8 blocks that moepage refuses until a GPU test finds them
    exact: their CPU tests build and load them."""
    from moepage.integrations.sglang import checks

    saved = checks.SERVED, checks.FP8_BLOCKS
    checks.SERVED = (*checks.SERVED, *formats)
    checks.FP8_BLOCKS = (*checks.FP8_BLOCKS, *(list(b) for b in fp8_blocks))
    try:
        yield
    finally:
        checks.SERVED, checks.FP8_BLOCKS = saved


def quant_pair(make_config, ckpt):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    def layer():
        with set_default_torch_dtype(torch.bfloat16):
            return FusedMoE(num_experts=FMT_E, hidden_size=FMT_H, intermediate_size=FMT_I, layer_id=0, top_k=2,
                            prefix="model.layers.0.mlp.experts", quant_config=make_config())

    with server_args():
        ref = layer()
        load_experts(ref, ckpt)
    with server_args(**paged_args()), admitted():  # small FP8 blocks: their loading, not their steps
        graph_config()
        paged = layer()
        load_experts(paged, ckpt)
    return ref, paged


def has_sgl_kernel() -> bool:
    try:
        import sgl_kernel  # noqa: F401
    except Exception:
        return False
    return True
