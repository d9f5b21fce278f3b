"""Tiny random Hugging Face models of the architectures the loader tests read and write, and how
those tests run and compare them."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM  # noqa: E402

import moepage  # noqa: E402

COMMON = dict(
    vocab_size=96, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)


def configs() -> dict[str, tuple[object, int]]:
    """model_type -> (tiny config, K). K is top_k or top_k + 1: the prompt needs several waves."""
    from transformers import (
        DeepseekV3Config,
        Glm4MoeConfig,
        GptOssConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    return {
        "qwen2_moe": (Qwen2MoeConfig(**COMMON, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                     shared_expert_intermediate_size=32, num_hidden_layers=2, num_experts=8,
                                     num_experts_per_tok=2), 3),
        "qwen3_moe": (Qwen3MoeConfig(**COMMON, hidden_size=64, head_dim=16, intermediate_size=64,
                                     moe_intermediate_size=16, num_hidden_layers=2, num_experts=16,
                                     num_experts_per_tok=4), 5),
        "mixtral": (MixtralConfig(**COMMON, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                  num_local_experts=8, num_experts_per_tok=2), 2),
        "olmoe": (OlmoeConfig(**COMMON, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_experts=16,
                              num_experts_per_tok=2), 3),
        "deepseek_v3": (DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, hidden_size=32, intermediate_size=64,
                                         moe_intermediate_size=16, num_hidden_layers=3, first_k_dense_replace=1,
                                         n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                         n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                         qk_nope_head_dim=8, v_head_dim=8), 3),
        "glm4_moe": (Glm4MoeConfig(**COMMON, hidden_size=48, head_dim=12, intermediate_size=64,
                                   moe_intermediate_size=16, num_hidden_layers=3, first_k_dense_replace=1,
                                   n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                   n_shared_experts=1), 4),
        "gpt_oss": (GptOssConfig(**COMMON, hidden_size=32, head_dim=8, intermediate_size=32, num_hidden_layers=2,
                                 num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
                                 layer_types=["sliding_attention", "full_attention"]), 3),
    }


ARCHS = list(configs())


IMPLS = ["eager", "grouped_mm", "batched_mm"]


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


FORMATS = {"per_expert": True, "stacked": False}  # save_pretrained(save_original_format=...)


def own(model):
    """Give every parameter owned, allocator-aligned storage (see the module docstring)."""
    for p in model.parameters():
        p.data = p.data.clone()
    return model


def reference(path, dtype, impl, device="cpu"):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation=impl)
    return own(model).to(device).eval()


def run(model, device="cpu"):
    """Prompt logits and greedy generate (tokens + per-step logits) for a fixed 2 x 24 prompt."""
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        logits = model(ids).logits
    gen = model.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return logits, gen.sequences, gen.logits


def assert_same(ref, got):
    logits, seq, steps = ref
    assert torch.equal(logits, got[0]), f"prompt logits differ, max |d| = {(logits - got[0]).abs().max().item()}"
    assert torch.equal(seq, got[1]), "generated tokens differ"
    assert len(steps) == len(got[2]) == 8
    for i, (a, b) in enumerate(zip(steps, got[2])):
        assert torch.equal(a, b), f"generate step {i}: logits differ, max |d| = {(a - b).abs().max().item()}"


def assert_paged(model, k):
    stats = moepage.stats(model)
    assert stats, "no layer was paged"
    assert all(layer.num_slots == k for layer in moepage.paged_layers(model))
    total = stats.total
    assert total.waves > total.steps, "the prompt should need several waves"
    assert total.misses > 0


def make_checkpoints(tmp_path_factory):
    """``get(arch, fmt) -> (path, K)``: a tiny random model saved once per module."""
    made: dict = {}

    def get(arch: str, fmt: str = "per_expert"):
        if (arch, fmt) not in made:
            config, k = configs()[arch]
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
            path = tmp_path_factory.mktemp(f"{arch}-{fmt}")
            model.save_pretrained(path, save_original_format=FORMATS[fmt])
            made[arch, fmt] = (str(path), k)
        return made[arch, fmt]

    return get
