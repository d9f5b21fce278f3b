"""The architecture matrix in bf16 on CUDA (its kernels differ from the CPU's), and gpt-oss's
captured decode of more than K entries between eager prefills."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import moepage
from helpers import support
from helpers.hf_registry import moe_archs
from helpers.matrix import assert_equal, outputs_on, unpaged
from moepage.integrations.transformers.decode import StaticDecode

ARCHS = {a.model_type: a for a in moe_archs()}


cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


CUDA_CASES = [(a.model_type, impl) for a in ARCHS.values() if not support.moepage_refusal(a)
              for impl in support.impls_of(a)]


@pytest.mark.parametrize("model_type, impl", CUDA_CASES, ids=["-".join(c) for c in CUDA_CASES])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_bf16_paged_equals_unpaged(model_type, impl, mark):
    """Every architecture of the matrix in bf16 on CUDA, whose kernels differ from the CPU's:
    prompt logits and greedy generate at K = top_k (the prompt needs several waves)."""
    arch = ARCHS[model_type]
    case = support.Case(model_type, impl, "bf16", "top_k", "generate")
    ref = unpaged(arch, case).to("cuda")
    model = unpaged(arch, case).to("cuda")
    moepage.wrap(model, resident=arch.top_k)
    assert_equal(outputs_on(ref, arch, "cuda"), outputs_on(model, arch, "cuda"), str(case))
    total = moepage.stats(model).total
    assert total.misses > 0 and total.waves > total.steps


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_gpt_oss_captured_decode_of_more_than_k_entries_between_eager_prefills(impl, mark):
    """gpt-oss (expert biases) in bf16: decode steps of 3 tokens x top-3 = 9 entries > K = 3 run as
    device-planned waves captured in one CUDA graph, replayed, then an eager (host-planned)
    prefill, then replays again: every step's logits equal the unpaged model's."""
    pytest.importorskip("cuda.bindings", reason="needs cuda-python (pip install 'moepage[cuda]')")

    # A window wider than the cache: a full sliding layer rolls its keys with an index tensor built from the host at
    # every step (transformers' StaticSlidingWindowLayer), which a CUDA graph cannot record.
    arch = ARCHS["gpt_oss"]
    arch = replace(arch, config=copy.deepcopy(arch.config))
    arch.config.sliding_window = 64
    case = support.Case("gpt_oss", impl, "bf16", "top_k", "generate")
    ref, model = (unpaged(arch, case).to("cuda") for _ in range(2))
    for m in (ref, model):
        m.config._attn_implementation = "eager"  # no value-dependent mask shortcut: capturable
    moepage.wrap(model, resident=arch.top_k, backend="cuda")
    prompts = [[5, 9, 17, 33, 2, 8, 71, 40], list(range(3, 60, 4)), [11, 12, 13]]

    def rounds(m, captured: bool) -> list[torch.Tensor]:
        dec, seen = StaticDecode(m, prompts, new_tokens=4), []
        for _ in range(2):  # eager prefill, then decode steps (warm-up, then one graph replayed across prefills)
            token = dec.prefill().argmax(-1, keepdim=True)
            for i in range(4):
                dec.feed(i, token)
                logits = dec.graph_step() if captured else dec.step()
                seen.append(logits.float().clone())
                token = logits.argmax(-1, keepdim=True)
        assert not captured or dec.graph is not None
        return seen

    with torch.no_grad():
        got, want = rounds(model, True), rounds(ref, False)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), [i for i, (a, b) in enumerate(zip(got, want))
                                                               if not torch.equal(a, b)]
    layer = next(moepage.paged_layers(model))
    # several device waves per step
    assert int(layer.pager.device_state.counters[1]) > int(layer.pager.device_state.counters[0])
