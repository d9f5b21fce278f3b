"""``StaticDecode`` on the models with sliding-window layers (found from transformers' registry): its step masks put
each sliding layer's keys where transformers' rolled cache holds them, so a static-cache decode gives the tokens a
full recomputation gives; and a paged model decodes it exactly as the unpaged one, device-planned steps of more than
K entries included (the path a CUDA graph captures)."""

from __future__ import annotations

import pytest
import torch

import moepage
from helpers import support
from helpers.hf_registry import moe_archs
from helpers.matrix import unpaged
from moepage.integrations.transformers.decode import greedy, left_padded

SLIDING = [a for a in moe_archs() if a.causal_lm and not support.moepage_refusal(a)
           and "sliding_attention" in (getattr(a.config.get_text_config(decoder=True), "layer_types", None) or [])]
# A prompt at least the window wide (full from the start) and short ones (the window fills while decoding).
PROMPTS = [[5, 9, 17, 33, 2, 8, 71, 40], list(range(3, 60, 4)), [11, 12, 13]]
NEW_TOKENS = 8


def test_the_registry_has_sliding_window_models():
    assert SLIDING, "no MoE model with sliding-window layers found in transformers' registry"


def _model(arch, impl: str, dtype: str):
    model = unpaged(arch, support.Case(arch.model_type, impl, dtype, "top_k", "generate"))
    model.config._attn_implementation = "eager"  # the 4D step masks go through as given
    return model


@pytest.mark.parametrize("arch", SLIDING, ids=[a.model_type for a in SLIDING])
def test_static_decode_equals_recomputation(arch, single_thread):
    model = _model(arch, support.impls_of(arch)[0], "fp32")
    with torch.no_grad():
        tokens, logits = greedy(model, PROMPTS, new_tokens=NEW_TOKENS)
        ids, mask = left_padded(PROMPTS, 0, "cpu")
        for i in range(tokens.shape[1]):
            seen = torch.cat([mask, torch.ones(len(PROMPTS), i, dtype=mask.dtype)], 1)
            full = model(input_ids=torch.cat([ids, tokens[:, :i]], 1), attention_mask=seen,
                         position_ids=(seen.cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
            torch.testing.assert_close(logits[i], full.float(), rtol=1e-4, atol=1e-4, msg=f"step {i}")


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("arch", SLIDING, ids=[a.model_type for a in SLIDING])
def test_paged_static_decode_of_more_than_k_entries_equals_unpaged(arch, impl, single_thread):
    """Decode steps of 3 tokens x top_k > K entries on the device planner (capture_mode), in bf16."""
    if impl not in support.impls_of(arch):
        pytest.skip(f"{arch.model_type} runs only {support.impls_of(arch)}")
    ref, model = _model(arch, impl, "bf16"), _model(arch, impl, "bf16")
    moepage.wrap(model, resident=arch.top_k, backend="torch", device_planner=True)
    want = greedy(ref, PROMPTS, new_tokens=NEW_TOKENS)
    with moepage.capture_mode():
        got = greedy(model, PROMPTS, new_tokens=NEW_TOKENS)
    assert torch.equal(got[0], want[0])
    assert [i for i, (a, b) in enumerate(zip(got[1], want[1])) if not torch.equal(a, b)] == []
    assert moepage.stats(model).total.waves > moepage.stats(model).total.steps  # several waves per step
