"""Property tests of ``plan_waves`` / ``Residency`` against a from-scratch LRU model (``RefLRU``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.reference import RefLRU, assert_matches_ref, check_residency, lru_order
from moepage.residency import EMPTY, Residency, Wave, plan_waves


class Recording(Residency):
    """A Residency that snapshots its state before and after every ``place``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.snapshots: list[tuple[Residency, Residency]] = []

    def _copy(self) -> Residency:
        out = Residency(self.num_experts, self.num_slots, self.policy)
        out.load_table(self.table())
        return out

    def place(self, experts, *args, **kwargs) -> Wave:
        before = self._copy()
        wave = super().place(experts, *args, **kwargs)
        self.snapshots.append((before, self._copy()))
        return wave


@st.composite
def scenarios(draw):
    e = draw(st.integers(1, 24))
    k = draw(st.integers(1, e))
    hot = draw(st.lists(st.integers(0, e - 1), min_size=1, max_size=e, unique=True))
    ops = []
    for _ in range(draw(st.integers(1, 25))):
        if draw(st.integers(0, 9)) == 0:  # a failed page-in empties some slots
            ops.append(("forget", draw(st.lists(st.integers(0, k - 1), max_size=k, unique=True))))
        else:  # a step routes a subset, mostly of a hot set (so hits happen), sometimes anything
            universe = st.sampled_from(hot) if draw(st.booleans()) else st.integers(0, e - 1)
            ops.append(("step", draw(st.lists(universe, max_size=3 * e))))
    return e, k, ops


def check_step(res: Recording, ref: RefLRU, routed: list[int], waves: list[Wave]) -> None:
    k = res.num_slots
    distinct = sorted(set(routed))
    start = res.snapshots[0][0] if res.snapshots else res
    # every routed expert is served by exactly one wave, in as few waves as fit K
    served = [x for w in waves for x in w.experts]
    assert sorted(served) == distinct
    assert len(waves) == -(-len(distinct) // k)
    assert all(1 <= len(w.experts) <= k for w in waves)
    # experts resident at step start come first, before any missing one
    was_resident = [start.is_resident(x) for x in served]
    assert was_resident == sorted(was_resident, reverse=True)
    # (at most K are resident, so they all fit the first wave: later waves are all misses)
    assert [w.hits for w in waves] == [sum(was_resident)] + [0] * (len(waves) - 1) if waves else True
    assert len(res.snapshots) == len(waves)
    ref_waves = ref.step(routed)
    assert len(ref_waves) == len(waves)
    for wave, (before, after), (ref_experts, ref_loads) in zip(waves, res.snapshots, ref_waves):
        # ascending within hits and within misses; loads are exactly the misses
        hits = [x for x in wave.experts if before.is_resident(x)]
        misses = [x for x in wave.experts if not before.is_resident(x)]
        assert list(wave.experts) == sorted(hits) + sorted(misses)
        assert [x for x, _ in wave.loads] == sorted(misses)
        assert wave.hits == len(hits)
        # a wave's loads never evict an expert of the same wave, and target distinct slots
        load_slots = [s for _, s in wave.loads]
        assert len(set(load_slots)) == len(load_slots)
        evicted = {before.slot_expert[s] for s in load_slots} - {EMPTY}
        assert not evicted & set(wave.experts)
        for x in hits:
            assert before.expert_slot[x] == after.expert_slot[x]  # hits do not move
        # after the wave, its experts are resident at the slots the Wave says
        assert len(wave.slots) == len(wave.experts)
        for x, s in zip(wave.experts, wave.slots):
            assert after.expert_slot[x] == s and after.slot_expert[s] == x
        # untouched slots keep their experts
        for s in range(k):
            if s not in load_slots:
                assert after.slot_expert[s] == before.slot_expert[s]
        check_residency(after)
        # the independent LRU model agrees
        assert list(wave.experts) == ref_experts
        assert list(wave.loads) == ref_loads
    res.snapshots.clear()
    check_residency(res)
    assert_matches_ref(res, ref)


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_plan_waves_matches_reference(scenario):
    e, k, ops = scenario
    res = Recording(e, k)
    ref = RefLRU(e, k)
    check_residency(res)
    assert_matches_ref(res, ref)
    for op, arg in ops:
        if op == "forget":
            res.invalidate(arg)
            ref.forget(arg)
            check_residency(res)
            assert_matches_ref(res, ref)
            continue
        waves = plan_waves(res, arg)
        check_step(res, ref, arg, waves)


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_place_waves_directly(scenario):
    """``Residency.place`` on arbitrary waves (not only plan_waves' order) follows the same rule."""
    e, k, ops = scenario
    res, ref = Residency(e, k), RefLRU(e, k)
    for op, arg in ops:
        if op == "forget":
            res.invalidate(arg)
            ref.forget(arg)
        else:
            wave_experts = sorted(set(arg))[:k]
            wave = res.place(reversed(wave_experts))
            ref_experts, ref_loads = ref.wave(wave_experts)
            assert list(wave.experts) == ref_experts and list(wave.loads) == ref_loads
        check_residency(res)
        assert_matches_ref(res, ref)


@settings(max_examples=50, deadline=None)
@given(scenarios())
def test_table_round_trip(scenario):
    e, k, ops = scenario
    res = Residency(e, k)
    for op, arg in ops:
        if op == "forget":
            res.invalidate(arg)
        else:
            plan_waves(res, arg)
        copy_ = Residency(e, k)
        copy_.load_table(res.table())
        assert (copy_.slot_expert, copy_.expert_slot, copy_.last_use, copy_.clock) == (
            res.slot_expert, res.expert_slot, res.last_use, res.clock)


def test_initial_state_and_errors():
    res = Residency(5, 3)
    assert res.resident() == {0: 0, 1: 1, 2: 2}
    assert lru_order(res) == [0, 1, 2]
    assert plan_waves(res, []) == []
    assert res.clock == 0
    with pytest.raises(ValueError):
        res.place([0, 1, 2, 3])
    for bad in ((5, 0), (5, 6)):
        with pytest.raises(ValueError):
            Residency(*bad)


def test_worked_example():
    """A hand-checked trace: E=6, K=2."""
    res = Residency(6, 2)
    [w] = plan_waves(res, [1, 3])  # 1 hits slot 1; 3 evicts expert 0 (slot 0, oldest, lower slot)
    assert (w.experts, w.slots, w.loads) == ((1, 3), (1, 0), ((3, 0),))
    w1, w2 = plan_waves(res, [0, 3, 4, 5])  # 3 resident -> first; then 0; then 4, 5
    assert (w1.experts, w1.loads) == ((3, 0), ((0, 1),))
    assert (w2.experts, w2.loads) == ((4, 5), ((4, 0), (5, 1)))
    assert lru_order(res) == [4, 5]
    res.invalidate([1])
    [w] = plan_waves(res, [2, 4])  # 4 hits slot 0, 2 takes the empty slot 1
    assert (w.experts, w.slots, w.loads) == ((4, 2), (0, 1), ((2, 1),))
