"""``StaticDecode`` on the models whose static cache has sliding-window layers (found from transformers' registry and
its own cache classes): its step masks put each sliding layer's keys where transformers' rolled cache holds them, so
a static-cache decode gives the tokens a full recomputation gives, while the window fills and once it is full; a
paged model decodes it exactly as the unpaged one, device-planned steps of more than K entries included (the path a
CUDA graph captures). Window caches whose masks it cannot prepare, and graphs over a window that fills, are refused."""

from __future__ import annotations

import pytest
import torch

import moepage
from helpers import support
from helpers.hf_registry import moe_archs
from helpers.matrix import unpaged
from moepage.errors import ConfigError
from moepage.integrations.transformers.decode import StaticDecode, _sliding_window, greedy, left_padded


def _window_caches():
    """(model types whose masks StaticDecode prepares, those it refuses): every causal MoE model whose static cache
    has a sliding-window layer (a model whose static cache transformers cannot build is left out)."""
    from transformers import StaticCache

    served, refused = [], []
    for arch in moe_archs():
        if not arch.causal_lm or support.moepage_refusal(arch):
            continue
        try:
            cache = StaticCache(config=arch.config, max_cache_len=32)
        except Exception:  # transformers' own StaticCache does not build it (e.g. compressed attention layers)
            continue
        if not any(getattr(layer, "is_sliding", False) for layer in cache.layers):
            continue
        try:
            _sliding_window(arch.config, cache)
            served.append(arch)
        except ConfigError:
            refused.append(arch)
    return served, refused


SLIDING, REFUSED = _window_caches()
# Wide prompts (the window is full from the prefill on) and narrow ones (it fills while decoding).
BATCHES = {"full": [[5, 9, 17, 33, 2, 8, 71, 40], list(range(3, 60, 4)), [11, 12, 13]], "filling": [[5, 9, 17], [4, 5]]}
NEW_TOKENS = 8


def test_the_registry_has_sliding_window_models():
    assert SLIDING, "no MoE model with sliding-window layers found in transformers' registry"
    window = SLIDING[0].config.get_text_config(decoder=True).sliding_window
    assert len(BATCHES["filling"][0]) < window <= len(BATCHES["full"][1]), "the batches no longer bracket the window"


def _model(arch, impl: str, dtype: str):
    model = unpaged(arch, support.Case(arch.model_type, impl, dtype, "top_k", "generate"))
    model.config._attn_implementation = "eager"  # the 4D step masks go through as given
    return model


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("arch", SLIDING, ids=[a.model_type for a in SLIDING])
def test_static_decode_equals_recomputation(arch, batch, single_thread):
    prompts = BATCHES[batch]
    model = _model(arch, support.impls_of(arch)[0], "fp32")
    with torch.no_grad():
        tokens, logits = greedy(model, prompts, new_tokens=NEW_TOKENS)
        ids, mask = left_padded(prompts, 0, "cpu")
        for i in range(tokens.shape[1]):
            seen = torch.cat([mask, torch.ones(len(prompts), i, dtype=mask.dtype)], 1)
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
    want = greedy(ref, BATCHES["full"], new_tokens=NEW_TOKENS)
    with moepage.capture_mode():
        got = greedy(model, BATCHES["full"], new_tokens=NEW_TOKENS)
    assert torch.equal(got[0], want[0])
    assert [i for i, (a, b) in enumerate(zip(got[1], want[1])) if not torch.equal(a, b)] == []
    assert moepage.stats(model).total.waves > moepage.stats(model).total.steps  # several waves per step


@pytest.mark.parametrize("arch", REFUSED, ids=[a.model_type for a in REFUSED])
def test_window_caches_it_cannot_mask_are_refused(arch):
    with pytest.raises(ConfigError, match="StaticDecode: layers of type"):
        StaticDecode(_model(arch, support.impls_of(arch)[0], "fp32"), BATCHES["full"], new_tokens=2)


def test_graph_step_refuses_a_window_that_fills():
    """A full window rolls with a host-made index tensor at every step, which a CUDA graph cannot record: refused
    before anything is captured (on any device)."""
    arch = SLIDING[0]
    dec = StaticDecode(_model(arch, support.impls_of(arch)[0], "fp32"), BATCHES["full"], new_tokens=2)
    assert dec.window < dec.length
    with pytest.raises(ConfigError, match="cannot record"):
        dec.graph_step()
    assert dec.graph is None and not dec.warmed
