"""The captured step on its own (``PagedLayer.device_forward``, with the device planner on the CPU):
it reads no host state, counts its waves like host waves, refuses a host-planned layer, and a
failed gather forgets its slots. The interleavings of every kind of step are
``test_one_state.py``'s."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import moepage
from helpers.models import device_forward, layer_of
from helpers.reference import RefLRU, assert_matches_ref
from helpers.routing import draw_routing, random_inputs
from moepage.toy import ToyExperts

pytestmark = pytest.mark.usefixtures("single_thread")

H, I = 16, 8


def _toy_on_device_planner(impl: str, e: int, top_k: int, k: int, seed: int):
    """A ToyExperts and its paged copy, planned on the (CPU) device planner; and random sources."""
    torch.manual_seed(seed)
    ref = ToyExperts(e, H, I, top_k, impl)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=k, backend="torch", device_planner=True, policy="lru")
    return ref, paged, layer_of(paged), random.Random(seed + 1), torch.Generator().manual_seed(seed + 1)


def test_device_forward_alone_takes_no_host_state():
    """The captured unit needs nothing of the host residency: with it poisoned, steps of one and
    of several device waves stay exact, and a host step afterwards starts from what they left."""
    e, top_k, k = 16, 2, 4
    ref, paged, layer, rng, gen = _toy_on_device_planner("grouped_mm", e, top_k, k, seed=3)
    layer.pager.residency.load_table([-7] * len(layer.pager.residency.table()))  # garbage the device step must not read
    lru = RefLRU(e, k)
    for tokens in (2, 5, 1, 9, 2):
        ids, ref_ids, routed = draw_routing(rng, tokens, top_k, e, rng.sample(range(e), min(e, tokens * top_k)))
        x, w = random_inputs(tokens, H, top_k, torch.float32, gen)
        assert torch.equal(device_forward(layer, x, ids, w), ref(x, ref_ids, w))
        lru.step(routed)
    assert_matches_ref(layer.read_residency(), lru)
    ids, ref_ids, routed = draw_routing(rng, 12, top_k, e, rng.sample(range(e), 13))
    x, w = random_inputs(12, H, top_k, torch.float32, gen)
    assert torch.equal(paged(x, ids, w), ref(x, ref_ids, w))  # host-planned: 13 > K experts
    lru.step(routed)
    assert_matches_ref(layer.read_residency(), lru)
    layer.check_slots()


def test_device_waves_of_a_large_step_are_counted_like_host_waves():
    e, top_k, k = 16, 2, 4
    ref, paged, layer, rng, gen = _toy_on_device_planner("eager", e, top_k, k, seed=5)
    ids, ref_ids, routed = draw_routing(rng, 8, top_k, e, rng.sample(range(e), 11))  # 11 experts: 3 waves of 4
    x, w = random_inputs(8, H, top_k, torch.float32, gen)
    assert torch.equal(device_forward(layer, x, ids, w), ref(x, ref_ids, w))
    s = moepage.stats(paged).total
    # ⌈min(E, 16 entries) / K⌉ = 4 waves run; the last holds nothing and is not counted.
    assert (s.steps, s.waves, s.hits + s.misses) == (1, 3, 11)


def test_capture_mode_on_a_host_planned_layer_is_refused():
    torch.manual_seed(7)
    paged = ToyExperts(8, H, I, 2)
    moepage.wrap(paged, resident=4, backend="torch")  # no device planner on the CPU by default
    x, w = random_inputs(1, H, 2, torch.float32, torch.Generator().manual_seed(7))
    with moepage.capture_mode(), pytest.raises(moepage.ConfigError, match="plans its steps on the host"):
        paged(x, torch.tensor([[0, 5]]), w)


def test_failed_device_page_in_forgets_its_slots(monkeypatch):
    """A gather that raises after the planner placed its wave: the planned slots are forgotten,
    PageInError is raised, and the next steps are exact."""
    e, top_k, k = 16, 2, 4
    ref, paged, layer, rng, gen = _toy_on_device_planner("eager", e, top_k, k, seed=9)
    store = layer.store
    real = store.gather
    monkeypatch.setattr(store, "gather", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("link down")))
    ids, ref_ids, _ = draw_routing(rng, 2, top_k, e, [9, 10, 11, 12])  # four misses
    x, w = random_inputs(2, H, top_k, torch.float32, gen)
    with pytest.raises(moepage.PageInError, match="device page-in of 4 experts failed: link down"):
        device_forward(layer, x, ids, w)
    assert sum(s == -1 for s in layer.read_residency().slot_expert) == 4  # planned, never paged: forgotten
    monkeypatch.setattr(store, "gather", real)
    layer.check_slots()
    for _ in range(3):
        ids, ref_ids, _ = draw_routing(rng, 2, top_k, e, rng.sample(range(e), 4))
        x, w = random_inputs(2, H, top_k, torch.float32, gen)
        assert torch.equal(paged(x, ids, w), ref(x, ref_ids, w))
    layer.check_slots()
