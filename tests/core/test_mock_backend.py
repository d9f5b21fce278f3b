"""The mock backend: page-ins equal the reference LRU's, injected failures leave a consistent
residency and an exact next step, and a long soak keeps every invariant."""

from __future__ import annotations

import random
import re
import zlib

import pytest
import torch

import moepage
from helpers.models import layer_of, make_experts
from helpers.reference import RefLRU, assert_matches_ref, check_residency
from helpers.routing import draw_routing, random_inputs
from moepage.backends.mock import MockStore
from moepage.step import host_step


class _Nothing:
    """A wave runner that computes nothing (the paging path alone)."""

    direct = False

    def run(self, wave):
        pass

    def finish(self):
        return None


NOTHING = _Nothing()

pytestmark = pytest.mark.usefixtures("single_thread")

E, H, I, TOP_K, K = 10, 16, 8, 2, 4


def wrapped(impl: str = "eager", k: int = K, seed: int = 0, store: MockStore | None = None):
    paged, ref = make_experts(E, H, I, TOP_K, impl, torch.float32, seed=seed)
    store = store if store is not None else MockStore()
    moepage.wrap(paged, resident=k, backend=store, policy="lru")  # checked against RefLRU
    return paged, ref, store, layer_of(paged)


def random_step(rng: random.Random, gen: torch.Generator, e: int = E, top_k: int = TOP_K, max_tokens: int = 12):
    tokens = rng.randint(1, max_tokens)
    pool = rng.sample(range(e), rng.randint(top_k, min(e, tokens * top_k)))
    ids, ref_ids, distinct = draw_routing(rng, tokens, top_k, e, pool, pad_frac=rng.choice([0.0, 0.2]))
    x, w = random_inputs(tokens, H, top_k, torch.float32, gen)
    return ids, ref_ids, distinct, x, w


def assert_consistent(layer: moepage.PagedLayer) -> None:
    check_residency(layer.read_residency())
    layer.check_slots()  # every resident slot equals its host rows


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_log_matches_reference_lru(impl):
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    paged, ref, store, layer = wrapped(impl)
    lru = RefLRU(E, K)
    n_specs = len(layer.specs)
    assert n_specs == 2
    for step in range(60):
        ids, ref_ids, distinct, x, w = random_step(rng, gen)
        if impl == "grouped_mm":  # the grouped reference has no padding sentinel
            ids, ref_ids, distinct = draw_routing(rng, ids.shape[0], TOP_K, E, distinct)
        mark = len(store.log)
        out = paged(x, ids, w)
        assert torch.equal(out, ref(x, ref_ids, w))
        predicted = [(layer.name, x_, s) for _, loads in lru.step(distinct) for x_, s in loads]
        assert store.log[mark:] == predicted, f"step {step}"
        assert_matches_ref(layer.read_residency(), lru)
        assert store.row_copies == n_specs * len(store.log)  # every tensor of every logged load
        stats = moepage.stats(paged)[layer.name]
        assert stats.misses == len(store.log) and stats.bytes_paged == len(store.log) * layer.pager.row_bytes
    assert len(store.log) > 0
    assert_consistent(layer)


def _failure_case(case: str, store: MockStore, lru: RefLRU, distinct: list[int]) -> tuple[int, int]:
    """The copy number to fail for ``case`` and the index of the wave it falls in, planned on a
    copy of the reference model (copies go tensor by tensor, load by load within a wave)."""
    probe = RefLRU(lru.e, lru.k)
    probe.holder, probe.recency, probe.empty = dict(lru.holder), list(lru.recency), set(lru.empty)
    waves = [loads for _, loads in probe.step(distinct)]
    n_tensors = 2
    done = store.row_copies
    target_wave = {"first-copy": 0, "later-tensor": 0, "last-copy": 0, "mid-multi-wave": 1,
                   "last-wave": len(waves) - 1}[case]
    while not waves[target_wave]:  # the first wave may be all hits: fail the first wave that loads
        target_wave += 1
    before = done + n_tensors * sum(len(loads) for loads in waves[:target_wave])
    n = len(waves[target_wave])
    offset = {"first-copy": 1, "later-tensor": n + 1, "last-copy": 2 * n, "mid-multi-wave": 1, "last-wave": n + 1}[case]
    return before + offset, target_wave


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("case", ["first-copy", "later-tensor", "last-copy", "mid-multi-wave", "last-wave"])
def test_injected_failure(impl, case):
    rng, gen = random.Random(zlib.crc32(case.encode())), torch.Generator().manual_seed(3)
    paged, ref, store, layer = wrapped(impl)
    lru = RefLRU(E, K)
    # warm up so residency is not the initial one
    for _ in range(3):
        ids, _, distinct = draw_routing(rng, 6, TOP_K, E, rng.sample(range(E), 5))
        x, w = random_inputs(6, H, TOP_K, torch.float32, gen)
        assert torch.equal(paged(x, ids, w), ref(x, ids, w))
        lru.step(distinct)
    # a step of 3 waves (9..10 distinct experts, K=4)
    ids, _, distinct = draw_routing(rng, 8, TOP_K, E, rng.sample(range(E), rng.randint(9, 10)))
    x, w = random_inputs(8, H, TOP_K, torch.float32, gen)
    fail, wave_index = _failure_case(case, store, lru, distinct)
    store.fail_at = {fail}
    stats_before = moepage.stats(paged)[layer.name]
    waves_before = stats_before.waves
    with pytest.raises(moepage.PageInError, match=f"layer {layer.name}: mock failure on row copy #{fail} ") as info:
        paged(x, ids, w)
    assert store.row_copies == fail  # it stopped at the failing copy
    # the torn copy left garbage in its slot (which is why the slot must be forgotten)
    name, expert, slot = re.search(r"\((\w+), expert (\d+) -> slot (\d+)\)", str(info.value)).groups()
    assert not torch.equal(store.slots(layer.name, name)[int(slot)], store.host_rows(layer.name, name)[int(expert)])
    assert not layer.read_residency().is_resident(int(expert))
    assert moepage.stats(paged)[layer.name].waves == waves_before + wave_index
    # the reference: the waves were planned; the failing wave's slots and later ones are forgotten
    ref_waves = lru.step(distinct)
    lru.forget(s for _, loads in ref_waves[wave_index:] for _, s in loads)
    assert_matches_ref(layer.read_residency(), lru)
    assert_consistent(layer)
    # the next step (the same routing, then fresh ones) is exact
    for step in range(4):
        if step:
            ids, _, distinct = draw_routing(rng, 8, TOP_K, E, rng.sample(range(E), rng.randint(2, 10)))
            x, w = random_inputs(8, H, TOP_K, torch.float32, gen)
        mark = len(store.log)
        assert torch.equal(paged(x, ids, w), ref(x, ids, w))
        assert store.log[mark:] == [(layer.name, e_, s) for _, loads in lru.step(distinct) for e_, s in loads]
        assert_consistent(layer)


def test_failure_then_exact_whole_model():
    """Several layers share one store; a failure in layer 2 of a model forward."""
    import copy

    from moepage.toy import ToyMoE

    torch.manual_seed(2)
    model = ToyMoE(vocab=64, hidden=16, inter=16, layers=3, num_experts=8, top_k=2).eval()
    ref = copy.deepcopy(model)
    store = MockStore()
    moepage.wrap(model, resident=2, backend=store)
    ids = torch.randint(0, 64, (30,))
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))
        for n in (1, 7, 25, 3, 14):
            store.fail_at = {store.row_copies + n}
            with pytest.raises(moepage.PageInError):
                model(torch.randint(0, 64, (30,)))
            for layer in moepage.paged_layers(model):
                assert_consistent(layer)
            ids = torch.randint(0, 64, (30,))
            assert torch.equal(model(ids), ref(ids))


def test_non_pagein_error_is_wrapped():
    class Exploding(MockStore):
        def page_in(self, layer, loads):
            raise RuntimeError("DMA engine on fire")

    paged, ref, store, layer = wrapped(store=Exploding())
    ids = torch.tensor([[5, 6], [7, 8]])
    x, w = random_inputs(2, H, TOP_K, torch.float32)
    with pytest.raises(moepage.PageInError, match="DMA engine on fire") as info:
        paged(x, ids, w)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert_consistent(layer)
    assert layer.read_residency().is_resident(5) is False


def test_soak_paging_path():
    """20,000 random steps through the pager's own host wave loop with failures injected at a low
    rate; invariants every step, slot contents often, full exact forwards periodically."""
    rng, gen = random.Random(1234), torch.Generator().manual_seed(1234)
    e, k = 12, 4
    torch.manual_seed(9)
    paged, ref = make_experts(e, 8, 4, TOP_K, "eager", torch.float32, seed=9)
    store = MockStore()
    moepage.wrap(paged, resident=k, backend=store)
    layer = layer_of(paged)
    hot = list(range(e))
    failures = full = 0
    for step in range(20_000):
        if step % 1000 == 0:
            rng.shuffle(hot)
        # skewed routing: mostly a hot subset, sometimes anything, 1..3K distinct experts
        n = rng.choice((1, 2, 3, 4, 4, 5, 6, 9))
        distinct = set(rng.sample(hot[:6], min(n, 6))) if rng.random() < 0.7 else set(rng.sample(range(e), n))
        if rng.random() < 0.02:
            store.fail_at.add(store.row_copies + rng.randint(1, 4))
        try:
            host_step(layer.pager, torch.tensor(sorted(distinct)), NOTHING)
        except moepage.PageInError:
            failures += 1
        store.fail_at = {f for f in store.fail_at if f > store.row_copies}
        res = layer.read_residency()
        # invariants, every step
        slot_expert, expert_slot = res.slot_expert, res.expert_slot
        for s, x in enumerate(slot_expert):
            assert x == -1 or expert_slot[x] == s
        assert sum(s != -1 for s in expert_slot) == sum(x != -1 for x in slot_expert)
        if step % 97 == 0:
            layer.check_slots()
        if step % 500 == 0:
            check_residency(res)
            store.log.clear()
            store.fail_at.clear()  # the exact forward below runs without injected failures
            ids, ref_ids, _ = draw_routing(rng, 9, TOP_K, e, rng.sample(range(e), rng.randint(2, e)), pad_frac=0.2)
            x, w = random_inputs(9, 8, TOP_K, torch.float32, gen)
            assert torch.equal(paged(x, ids, w), ref(x, ref_ids, w))
            full += 1
    assert failures > 20 and full == 40 and store.row_copies > 40_000
    layer.check_slots()
