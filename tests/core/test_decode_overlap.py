"""Overlapped captured steps (``MOEPAGE_DECODE_OVERLAP``): a device-planned step of more than K experts runs waves of
K // 2, each planned and paged in beside the previous wave's computation (on CUDA, the copy stream; here, in order).

What must hold on any device: the step equals the unpaged layer (``torch.equal``), its waves are the ones fixed by
shapes (⌈min(E, entries) / (K // 2)⌉), and the layer's residency is ``plan_waves``'s with waves of K // 2 (each
wave evicting the previous wave's slots last, so it takes none of them). The planner's rule itself is
``tests/core/test_kernels.py``'s; interleavings with host steps, prefetches and replays, ``test_one_state.py``'s."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import moepage
from helpers.models import device_forward, layer_of
from helpers.routing import draw_routing, random_inputs
from helpers.support import IMPLS
from moepage import step
from moepage.nn import layer as layer_module
from moepage.residency import Residency, plan_waves
from moepage.toy import ToyExperts

pytestmark = pytest.mark.usefixtures("single_thread")

H, I = 16, 8


@pytest.fixture
def waves_seen(monkeypatch):
    """Every wave a step's runner is handed: (index, count)."""
    seen: list[tuple[int, int]] = []
    run = layer_module.ModuleWaves.run

    def spied(self, wave):
        seen.append((wave.index, wave.count))
        run(self, wave)

    monkeypatch.setattr(layer_module.ModuleWaves, "run", spied)
    return seen


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overlapped_steps_equal_unpaged_in_waves_of_half_k(waves_seen, monkeypatch, impl, dtype):
    e, top_k = 16, 2
    monkeypatch.setenv("MOEPAGE_DECODE_OVERLAP", "on")  # read at wrap
    for k, policy, seed in ((top_k, "lru", 1), (5, "lfu:3", 2), (e // 2, "lru", 3)):
        torch.manual_seed(seed)
        ref = ToyExperts(e, H, I, top_k, impl).to(dtype)
        paged = copy.deepcopy(ref)
        moepage.wrap(paged, resident=k, backend="torch", device_planner=True, policy=policy)
        layer = layer_of(paged)
        model = Residency(e, k, policy)
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        for distinct in (top_k, k, k + 1, 2 * k, min(e, 3 * k + 1), e, k + 1, e):
            tokens = max(-(-distinct // top_k), k // top_k + 1)  # more than K entries
            ids, ref_ids, routed = draw_routing(rng, tokens, top_k, e, rng.sample(range(e), distinct))
            x, w = random_inputs(tokens, H, top_k, dtype, gen)
            waves_seen.clear()
            assert torch.equal(device_forward(layer, x, ids, w), ref(x, ref_ids, w)), (k, distinct)
            count = -(-min(e, ids.numel()) // (k // 2))
            assert waves_seen == [(i, count) for i in range(count)], (k, distinct)
            plan_waves(model, routed, k // 2)
            assert layer.pager.read_residency().table() == model.table(), (k, distinct)
            layer.pager.check_slots()


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_waves_of_half_k_only_for_steps_of_more_than_k_when_opted_in(monkeypatch, overlap):
    e = 16
    monkeypatch.setenv("MOEPAGE_DECODE_OVERLAP", overlap)
    for top_k, k in ((1, 1), (2, 2), (2, 6)):  # K = 1 cannot be halved
        paged = ToyExperts(e, H, I, top_k)
        moepage.wrap(paged, resident=k, backend="torch", device_planner=True)
        pager = layer_of(paged).pager
        assert step.device_wave_width(pager, k) == k  # a step that fits one wave of K
        half = k // 2 if overlap == "on" and k >= 2 else k
        assert step.device_wave_width(pager, k + 1) == step.device_wave_width(pager, 10 * e) == half
        assert step.device_wave_count(pager, 10 * e) == -(-e // half)


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_every_wave_s_page_in_takes_the_step_s_grid(monkeypatch, overlap):
    """A step's page-ins take the store's full grid, overlapped waves' too: beside the previous wave's computation, the
    background grid a prefetch takes made overlapped steps slower (bench/RESULTS.md)."""
    from moepage.backends.store import Store

    asked: list[bool] = []
    gather = Store.gather

    def spied(self, *args, background=False):
        asked.append(background)
        gather(self, *args, background=background)

    monkeypatch.setattr(Store, "gather", spied)
    monkeypatch.setenv("MOEPAGE_DECODE_OVERLAP", overlap)
    e, top_k, k = 16, 2, 4
    paged = ToyExperts(e, H, I, top_k)
    moepage.wrap(paged, resident=k, backend="torch", device_planner=True)
    layer = layer_of(paged)
    ids, _, _ = draw_routing(random.Random(0), 8, top_k, e, list(range(e)))
    x, w = random_inputs(8, H, top_k, torch.float32, torch.Generator().manual_seed(0))
    device_forward(layer, x, ids, w)
    count = step.device_wave_count(layer.pager, ids.numel())
    assert count == (8 if overlap == "on" else 4)
    assert asked == [False] * count
