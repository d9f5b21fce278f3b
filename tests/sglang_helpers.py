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


def build_model(kind: str, dtype: torch.dtype, quant_config=None):
    """The SGLang model class of ``kind`` built under the published config and loaded from the
    tiny checkpoint through SGLang's ``DefaultModelLoader`` (loaders + post-load steps)."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    model = construct(kind, hf_config(kind), dtype, quant_config)
    path = checkpoint(kind, dtype)
    DefaultModelLoader.load_weights_and_postprocess(model, checkpoint_weights(path), torch.device("cpu"))
    return model


def moe_layers(model):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def routing(rng: random.Random, tokens: int, num_distinct: int, top_k: int = TOP_K, e: int = E):
    """``[tokens, top_k]`` int32 ids, distinct per token, covering exactly ``num_distinct`` experts."""
    from conftest import draw_routing  # the suite's one routing generator

    ids, _, _ = draw_routing(rng, tokens, top_k, e, pool=rng.sample(range(e), num_distinct))
    return ids.to(torch.int32)


def topk_output(ids: torch.Tensor, seed: int = 0):
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    g = torch.Generator().manual_seed(seed)
    w = torch.rand(ids.shape, generator=g)
    w = w / w.sum(dim=1, keepdim=True)
    return StandardTopKOutput(topk_weights=w, topk_ids=ids, router_logits=None)
