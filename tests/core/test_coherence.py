"""One residency truth: the flows serving engines run, interleaved, on the CPU.

Engines capture decode in CUDA graphs and run prefill eagerly in between. A replay runs no Python,
so the captured step must read and write nothing but device state, and an eager host-planned step
must start from what the replays left. Here, with the device planner on the CPU (the torch
planner and gather), random interleavings of

- host-planned steps of one, two and many waves (``forward`` of more than K entries), with
  ``prefill_overlap`` on and off, odd and even K;
- device-planned steps through ``PagedLayer.device_forward`` (the unit a graph captures), of one
  wave and of several (a captured batch larger than K // top_k), called directly with no
  Python-side state move;

must each equal the unpaged module (``torch.equal``), leave every resident slot equal to its host
row, and follow an independent LRU model (``conftest.RefLRU``) entry for entry.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moepage
from moepage.residency import Residency, plan_waves
from moepage.toy import ToyExperts

from helpers.flows import KINDS, distinct_for as _distinct_for, tokens_for as _tokens_for
from helpers.models import layer_of
from helpers.reference import RefLRU, assert_matches_ref, check_residency
from helpers.routing import draw_routing, random_inputs

pytestmark = pytest.mark.usefixtures("single_thread")

H, I = 16, 8
def _step(layer, paged, ref, kind, ids, ref_ids, x, w):
    if kind.startswith("device"):
        return layer.device_forward(x, ids, w), ref(x, ref_ids, w)
    return paged(x, ids, w), ref(x, ref_ids, w)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    impl=st.sampled_from(["eager", "grouped_mm", "batched_mm"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    shape=st.sampled_from([(8, 2, 2), (8, 2, 3), (12, 2, 5), (12, 3, 6), (16, 2, 7), (8, 2, 8), (16, 4, 4)]),
    overlap=st.booleans(),
    policy=st.sampled_from(["lru", "lfu:3"]),
    kinds=st.lists(st.sampled_from(KINDS), min_size=6, max_size=14),
    seed=st.integers(0, 2**31 - 1),
)
def test_interleaved_host_and_device_steps_share_one_state(impl, dtype, shape, overlap, policy, kinds, seed):
    e, top_k, k = shape  # K = top_k and K = E among them, odd and even K
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    ref = ToyExperts(e, H, I, top_k, impl).to(dtype)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=k, backend="torch", device_planner=True, prefill_overlap=overlap, policy=policy)
    layer = layer_of(paged)
    lru = RefLRU(e, k)  # an independent model of the LRU rule
    host_only = Residency(e, k, policy)  # the policy's rule with every step planned on the host
    misses = 0
    for i, kind in enumerate(kinds):
        distinct = _distinct_for(kind, rng, e, k, top_k)
        if distinct is None:
            continue
        tokens = _tokens_for(kind, rng, distinct, k, top_k)
        pool = rng.sample(range(e), distinct)
        ids, ref_ids, routed = draw_routing(rng, tokens, top_k, e, pool, pad_frac=0.2 if impl == "eager" else 0.0)
        x, w = random_inputs(tokens, H, top_k, dtype, gen)
        out, want = _step(layer, paged, ref, kind, ids, ref_ids, x, w)
        assert torch.equal(out, want), f"step {i} ({kind}): max diff {(out.float() - want.float()).abs().max()}"
        # The same decisions as planning every step on the host, whichever planner ran the step.
        split = overlap and not kind.startswith("device") and len(routed) > k and k >= 2
        waves = plan_waves(host_only, routed, k // 2 if split else None)
        misses += sum(len(w.loads) for w in waves)
        res = layer.read_residency()
        check_residency(res)
        assert res.table() == host_only.table()
        if policy == "lru":
            lru.step(routed, k // 2 if split else None)
            assert_matches_ref(res, lru)
        layer.check_slots()  # every resident slot holds its expert's host row
        assert moepage.stats(paged).total.misses == misses
    moepage.unwrap(paged)  # after any mix: the module's own E rows back, computing as before
    for name, param in ref.named_parameters():
        assert torch.equal(paged.get_parameter(name), param)
    x, w = random_inputs(5, H, top_k, dtype, gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(5)])
    assert torch.equal(paged(x, ids, w), ref(x, ids, w))


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
    layer.pager.host.load_table([-7] * len(layer.pager.host.table()))  # garbage the device step must not read
    lru = RefLRU(e, k)
    for tokens in (2, 5, 1, 9, 2):
        ids, ref_ids, routed = draw_routing(rng, tokens, top_k, e, rng.sample(range(e), min(e, tokens * top_k)))
        x, w = random_inputs(tokens, H, top_k, torch.float32, gen)
        assert torch.equal(layer.device_forward(x, ids, w), ref(x, ref_ids, w))
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
    assert torch.equal(layer.device_forward(x, ids, w), ref(x, ref_ids, w))
    s = moepage.stats(paged).total
    # ⌈min(E, 16 entries) / K⌉ = 4 waves run; the last holds nothing and is not counted.
    assert (s.steps, s.waves, s.hits + s.misses) == (1, 3, 11)


def test_capture_mode_on_a_host_planned_layer_is_refused():
    torch.manual_seed(7)
    paged = ToyExperts(8, H, I, 2)
    moepage.wrap(paged, resident=4, backend="torch")  # no device planner on the CPU by default
    x, w = random_inputs(1, H, 2, torch.float32, torch.Generator().manual_seed(7))
    with moepage.capture_mode(), pytest.raises(moepage.ConfigError, match="plans on the host"):
        paged(x, torch.tensor([[0, 5]]), w)


def test_failed_device_page_in_forgets_its_slots(monkeypatch):
    """A gather that raises after the planner placed its wave: the planned slots are forgotten,
    PageInError is raised, and the next steps are exact."""
    e, top_k, k = 16, 2, 4
    ref, paged, layer, rng, gen = _toy_on_device_planner("eager", e, top_k, k, seed=9)
    store = layer.store
    real = store.gather
    monkeypatch.setattr(store, "gather", lambda *a: (_ for _ in ()).throw(RuntimeError("link down")))
    ids, ref_ids, _ = draw_routing(rng, 2, top_k, e, [9, 10, 11, 12])  # four misses
    x, w = random_inputs(2, H, top_k, torch.float32, gen)
    with pytest.raises(moepage.PageInError, match="device page-in of 4 experts failed: link down"):
        layer.device_forward(x, ids, w)
    assert sum(s == -1 for s in layer.read_residency().slot_expert) == 4  # planned, never paged: forgotten
    monkeypatch.setattr(store, "gather", real)
    layer.check_slots()
    for _ in range(3):
        ids, ref_ids, _ = draw_routing(rng, 2, top_k, e, rng.sample(range(e), 4))
        x, w = random_inputs(2, H, top_k, torch.float32, gen)
        assert torch.equal(paged(x, ids, w), ref(x, ref_ids, w))
    layer.check_slots()
