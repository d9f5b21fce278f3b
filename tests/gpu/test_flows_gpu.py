"""The serving flow on CUDA: captured decode replayed between eager steps, on HF's experts and the
toy, a static-cache decode captured in one graph, and captured steps skipping their empty waves."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import moepage
from helpers.flows import REPLAYS, ROUNDS, Static, decode_equal, hf_experts, rounds
from helpers.routing import draw_routing, random_inputs
from moepage import capture
from moepage import step as moepage_step
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


@pytest.mark.parametrize("skip", ["on", "off"])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_gpu_captured_step_skips_the_waves_routing_leaves_empty(skip, mark, monkeypatch):
    """A captured step of 3 waves (24 entries, K = 8) takes its waves 2 and 3 as if-nodes where torch has graph
    conditionals (none with MOEPAGE_SKIP_EMPTY_WAVES=off); replays routing 1, 2 and 3 waves' worth of experts, between
    eager steps, equal the unpaged layer's."""
    pytest.importorskip("cuda.bindings", reason="needs cuda-python (pip install 'moepage[cuda]')")
    if not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        pytest.skip(f"torch {torch.__version__} has no CUDA-graph conditionals (begin_capture_to_if_node)")
    monkeypatch.setenv("MOEPAGE_SKIP_EMPTY_WAVES", skip)
    begun = []
    real = capture._capturing_graph

    class Counted:  # the capturing graph, counting the if-nodes begun on it
        def __init__(self, graph):
            self.graph = graph

        def begin_capture_to_if_node(self, pred):
            self.graph.begin_capture_to_if_node(pred)
            begun.append(pred)

        def end_capture_to_conditional_node(self):
            self.graph.end_capture_to_conditional_node()

    monkeypatch.setattr(capture, "_capturing_graph", lambda: None if real() is None else Counted(real()))
    ref, hidden = hf_experts("grouped_mm")
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=8, backend="cuda")
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)

    def step(tokens, distinct):
        ids, ref_ids, _ = draw_routing(rng, tokens, 4, 32, rng.sample(range(32), distinct))
        x, w = random_inputs(tokens, hidden, 4, torch.bfloat16, gen)
        return x.cuda(), ids.cuda(), w.cuda(), ref_ids.cuda()

    g = Static(paged, 6, hidden, 4, torch.bfloat16, "cuda")
    x, idx, w, ref_idx = step(6, 20)
    g.fill(x, idx, w)
    assert torch.equal(g.capture(), ref(x, ref_idx, w))
    assert len(begun) == (2 if skip == "on" else 0)
    for distinct in (4, 8, 9, 16, 17, 24, 6, 12, 20) * 3:
        x, idx, w, ref_idx = step(6, distinct)
        g.fill(x, idx, w)
        assert torch.equal(g.replay(), ref(x, ref_idx, w)), distinct
        x, idx, w, ref_idx = step(16, min(32, 2 * distinct))  # eager, planned on the host
        assert torch.equal(paged(x, idx, w), ref(x, ref_idx, w))
    layer = next(moepage.paged_layers(paged))
    layer.check_slots()


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_gpu_overlapped_captured_steps_between_eager_steps(impl, mark, monkeypatch):
    """MOEPAGE_DECODE_OVERLAP: a captured step of 24 entries at K = 8 runs 6 waves of 4, each planned and paged in on
    the copy stream beside the previous wave's computation. Its replays, routing 1 to 6 waves' worth of experts between
    eager host-planned steps, equal the unpaged layer's, and the layer's residency stays ``plan_waves``'s (waves of 4
    for the replays, of K for the eager steps)."""
    pytest.importorskip("cuda.bindings", reason="needs cuda-python (pip install 'moepage[cuda]')")
    from moepage.residency import Residency, plan_waves

    monkeypatch.setenv("MOEPAGE_DECODE_OVERLAP", "on")
    ref, hidden = hf_experts(impl)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=8, backend="cuda", policy="lfu:3")
    layer = next(moepage.paged_layers(paged))
    model = Residency(32, 8, "lfu:3")
    rng, gen = random.Random(6), torch.Generator().manual_seed(6)

    def step(tokens, distinct):
        ids, ref_ids, routed = draw_routing(rng, tokens, 4, 32, rng.sample(range(32), distinct))
        x, w = random_inputs(tokens, hidden, 4, torch.bfloat16, gen)
        return x.cuda(), ids.cuda(), w.cuda(), ref_ids.cuda(), routed

    g = Static(paged, 6, hidden, 4, torch.bfloat16, "cuda")
    x, idx, w, ref_idx, routed = step(6, 20)
    g.fill(x, idx, w)
    assert torch.equal(g.capture(), ref(x, ref_idx, w))  # the warm-up step ran; the capture ran nothing
    plan_waves(model, routed, 4)
    assert moepage_step.device_wave_count(layer.pager, idx.numel()) == 6
    for distinct in (4, 8, 9, 16, 17, 24, 6, 12, 20) * 2:
        x, idx, w, ref_idx, routed = step(6, distinct)
        g.fill(x, idx, w)
        assert torch.equal(g.replay(), ref(x, ref_idx, w)), distinct
        plan_waves(model, routed, 4)
        x, idx, w, ref_idx, routed = step(16, min(32, 2 * distinct))  # eager, planned on the host
        assert torch.equal(paged(x, idx, w), ref(x, ref_idx, w))
        plan_waves(model, routed)
        assert layer.pager.read_residency().table() == model.table(), distinct
    layer.check_slots()
