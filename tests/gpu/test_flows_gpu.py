"""The serving flow on CUDA: captured decode replayed between eager steps, on HF's experts and the
toy, and a static-cache decode captured in one graph."""

from __future__ import annotations

import copy

import pytest
import torch

import moepage
from helpers.flows import REPLAYS, ROUNDS, decode_equal, hf_experts, rounds
from moepage.toy import ToyExperts

gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuda backend, CUDA graphs)"),
]


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_gpu_capture_eager_replay_rounds_hf_experts(impl, mark):
    """The flow that broke (issue 10): E = 32, K = 8, top-4, bf16. HF's eager loop synchronises
    (``nonzero``), so it cannot be captured: there, eager device-planned steps stand in."""
    pytest.importorskip("cuda.bindings", reason="needs cuda-python (pip install 'moepage[cuda]')")
    ref, hidden = hf_experts(impl)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=8, backend="cuda", policy="lru")  # checked against RefLRU
    gen = torch.Generator().manual_seed(1)
    replays = rounds(paged, ref, 32, 4, hidden, torch.bfloat16, gen, capture=impl != "eager")
    assert replays == (ROUNDS * REPLAYS * 2 if impl != "eager" else 0)


@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_gpu_capture_eager_replay_rounds_toy_with_overlap(mark):
    pytest.importorskip("cuda.bindings", reason="needs cuda-python (pip install 'moepage[cuda]')")
    torch.manual_seed(2)
    ref = ToyExperts(32, 64, 128, 4, "batched_mm").to("cuda", torch.bfloat16)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=7, backend="cuda", prefill_overlap=True, policy="lru")
    gen = torch.Generator().manual_seed(3)
    assert rounds(paged, ref, 32, 4, 64, torch.bfloat16, gen, capture=True) == ROUNDS * REPLAYS * 2


@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_gpu_static_cache_decode_captured_equals_unpaged(mark):
    pytest.importorskip("cuda.bindings", reason="needs cuda-python (pip install 'moepage[cuda]')")
    paged = decode_equal("cuda", torch.bfloat16, graph=True, backend="cuda")
    assert all(int(layer.pager.device_state.counters[0]) > 0 for layer in moepage.paged_layers(paged))
