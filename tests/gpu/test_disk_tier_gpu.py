"""A disk tier on CUDA (``host_budget=``): slots on the GPU over H pinned host rows a layer over every row on disk,
raw and coded (``compress=True``: coded rows copied to the GPU and decoded there), steps of one, two and many waves
equal unpaged bit for bit, host memory exactly H rows a layer, some rows read from disk."""

from __future__ import annotations

import copy

import pytest
import torch

import moepage
from moepage.toy import ToyExperts

E, TOP_K, K, H = 32, 4, 7, 12


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("backend", [None, "torch"])
def test_gpu_disk_tier_steps_equal_unpaged(tmp_path, compress, backend) -> None:
    if backend is None:
        pytest.importorskip("cuda.bindings", reason="needs cuda-python (pip install 'moepage[cuda]')")
    torch.manual_seed(3)
    ref = ToyExperts(E, 256, 128, TOP_K, "batched_mm").to("cuda", torch.bfloat16).requires_grad_(False)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=K, host_budget=H, spill_dir=tmp_path, compress=compress, backend=backend)
    layer = next(moepage.paged_layers(paged))
    held = layer.store.layer_bytes(layer.name)
    assert bool(held.coded) == compress
    assert layer.store.host_bytes() == H * sum(s.host_nbytes for s in layer.specs.values())  # exactly H rows
    gen = torch.Generator(device="cuda").manual_seed(4)
    for t in (1, 2, 9, 64, 1, 33, 3):  # one wave, then two and many (more than K distinct experts)
        x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
        idx = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:TOP_K] for _ in range(t)])
        w = torch.rand(t, TOP_K, device="cuda", dtype=torch.bfloat16, generator=gen)
        assert torch.equal(paged(x, idx, w), ref(x, idx, w)), t
    tier = layer.store.tier_stats(layer.name)
    assert tier.host_misses > 0 and tier.disk_bytes == tier.host_misses * sum(s.host_nbytes
                                                                             for s in layer.specs.values())
    moepage.unwrap(paged)
    for got, want in zip(paged.parameters(), ref.parameters()):
        assert torch.equal(got, want)
