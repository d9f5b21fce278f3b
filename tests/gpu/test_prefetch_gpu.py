"""Prefetch on CUDA: captured decode with prefetch between eager prefills, and a static-cache decode."""

from __future__ import annotations

import copy

import pytest
import torch

import moepage
from helpers.flows import decode_equal
from helpers.reference import check_residency
from moepage.toy import ToyMoE

gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuda backend, CUDA graphs)"),
]


@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_gpu_captured_decode_with_prefetch_between_eager_prefills(mark):
    """A 3-layer toy model on the cuda backend, prefetch on: a graph of a 2-token decode step is
    replayed between eager, host-planned prefill steps; every output equals the unpaged model's."""
    pytest.importorskip("cuda.bindings", reason="needs cuda-python (pip install 'moepage[cuda]')")
    torch.manual_seed(7)
    ref = ToyMoE(vocab=128, hidden=64, inter=128, layers=3, num_experts=32, top_k=4,
                 implementation="batched_mm").to("cuda", torch.bfloat16)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=8, backend="cuda", prefetch=True)
    layers = list(moepage.paged_layers(paged))
    gen = torch.Generator(device="cuda").manual_seed(8)
    static = torch.randint(0, 128, (2,), device="cuda", generator=gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), moepage.capture_mode():
        assert torch.equal(paged(static), ref(static))  # warm-up: the kernels compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with moepage.capture_mode(), torch.cuda.graph(graph):
        out = paged(static)
    assert all(layer.pager._pending is None for layer in layers)  # every side stream joined
    for _ in range(10):
        prompt = torch.randint(0, 128, (48,), device="cuda", generator=gen)
        before = layers[1].read_stats().prefetched
        assert torch.equal(paged(prompt), ref(prompt))  # eager, host-planned waves; prefetches on the side stream
        assert layers[1].read_stats().prefetched >= before  # layer 0 prefetched for it; its own step awaited that
        for _ in range(3):
            static.copy_(torch.randint(0, 128, (2,), device="cuda", generator=gen))
            graph.replay()
            assert torch.equal(out, ref(static))
        for layer in layers:
            layer.check_slots()
            check_residency(layer.read_residency())
            assert layer.pager._pending is None
    total = moepage.stats(paged).total
    assert total.prefetched > 0 and total.misses > 0


@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_gpu_static_cache_decode_captured_with_prefetch(mark):
    pytest.importorskip("cuda.bindings", reason="needs cuda-python (pip install 'moepage[cuda]')")
    paged = decode_equal("cuda", torch.bfloat16, graph=True, backend="cuda", prefetch=True)
    assert moepage.stats(paged).total.prefetched > 0
