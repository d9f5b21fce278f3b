"""Runtime eviction policies (``residency.Policy``): the host rule against an independent model,
host/device decision equality (device-planned steps of one and several waves, by the torch planner
and the Triton kernel, interleaved with host-planned multi-wave steps on one device state),
prefill admission, and the overlap guarantee of ``plan_waves``."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.data import REAL_TRACES, load_real, needs_traces
from helpers.kernels import RULES
from helpers.reference import RefLRU, assert_matches_ref, check_residency, reference_of, state_of
from moepage.kernels.planner import plan_step_torch, plan_step_triton, triton_available
from moepage.pager import DeviceResidency
from moepage.planning import traces
from moepage.residency import EMPTY, LFRU, LFU, LRU, Policy, Residency, plan_waves, resolve_policy

HALF_LIVES = (0, 1, 2, 3, 5, 1024)  # 0 is LRU; small half-lives make the decay fire often


def policy_of(half_life: int) -> Policy:
    return Policy(f"h{half_life}", half_life)


# Every rule the planners must agree on: the named policies and both key orders (helpers.kernels.RULES), and more
# half-lives of the frequency-first order.
ANY_RULE = st.sampled_from([*RULES, *(policy_of(h) for h in HALF_LIVES)])


@st.composite
def steps_of(draw, e: int, count: int, width: int):
    hot = draw(st.lists(st.integers(0, e - 1), min_size=1, max_size=e, unique=True))
    out = []
    for _ in range(count):
        universe = st.sampled_from(hot) if draw(st.booleans()) else st.integers(0, e - 1)
        out.append(draw(st.lists(universe, max_size=width)))
    return out


# -- the rule ------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.data())
def test_every_rule_matches_its_independent_model(data):
    e = data.draw(st.integers(1, 20))
    k = data.draw(st.integers(1, e))
    policy = data.draw(ANY_RULE)
    res, ref = Residency(e, k, policy), reference_of(policy, e, k)
    for routed in data.draw(steps_of(e, data.draw(st.integers(1, 30)), 3 * e)):
        if data.draw(st.integers(0, 9)) == 0:
            slots = data.draw(st.lists(st.integers(0, k - 1), max_size=k, unique=True))
            res.invalidate(slots)
            ref.forget(slots)
        waves = plan_waves(res, routed)
        assert [(list(w.experts), list(w.loads)) for w in waves] == ref.step(routed)
        if policy.half_life:
            assert res.score == [ref.scores[x] for x in range(e)]
        assert res.resident() == ref.where()
        check_residency(res)


def test_worked_example():
    """E=4, K=2, half-life 4: frequency overrides recency; the decay fires at clock 4."""
    res, lru = Residency(4, 2, policy_of(4)), Residency(4, 2)
    for routed in ([0], [0], [1]):
        plan_waves(res, routed)
        plan_waves(lru, routed)
    assert res.score == [2, 1, 0, 0] and res.last_use == [2, 3]
    [w] = plan_waves(res, [2])  # clock 4: scores halve to [1, 0, 0, 0], then 2 gains 1
    assert res.score == [1, 0, 1, 0]
    assert w.loads == ((2, 1),)  # expert 1 (score 0) goes, though expert 0 is older
    assert plan_waves(lru, [2])[0].loads == ((2, 0),)  # LRU evicts the older one
    [w] = plan_waves(res, [3])  # scores tie at 1: the older slot (0, stamp 2) goes
    assert w.loads == ((3, 0),) and res.slot_expert == [3, 2] and res.score == [1, 0, 1, 1]


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(HALF_LIVES), st.integers(0, 2**32))
def test_scores_are_bounded(h, seed):
    rng = random.Random(seed)
    res = Residency(8, 3, policy_of(h))
    top = 0
    for _ in range(300):
        plan_waves(res, rng.sample(range(8), rng.randint(0, 3)) + [0])  # expert 0 in every wave
        top = max(top, max(res.score))
    assert min(res.score) >= 0
    assert top == (0 if h == 0 else min(300, 2 * h - 1))  # expert 0's score saturates at 2H - 1


def test_named_policies():
    assert (LRU.half_life, LFU.half_life, LFRU.half_life) == (0, 1024, 32)
    assert resolve_policy("LFU") is LFU and resolve_policy(LFRU) is LFRU
    assert resolve_policy("lfru:8") == Policy("lfru:8", 8)
    with pytest.raises(ValueError):
        Policy("bad", -1)
    with pytest.raises(TypeError):
        Residency(4, 2, 3)  # type: ignore[arg-type]
    res = Residency(4, 2, "lfu")
    plan_waves(res, [3])
    assert res.score == [0, 0, 0, 1] and Residency(4, 2).score == [0] * 4


# -- host/device decision equality ---------------------------------------------------------------
class Interleaved:
    """One layer's state in a ``DeviceResidency`` (the one truth, as the pager keeps it): device
    steps plan on it (the torch planner, or the Triton kernel under the interpreter), host steps
    pull it into a ``Residency``, plan there and push it back. Checked after every step against
    ``ref``, a Residency that plans every step on the host."""

    def __init__(self, e: int, k: int, policy: Policy, cold: bool = False, impl: str = "torch"):
        self.e, self.k, self.policy, self.impl = e, k, policy, impl
        self.ref, self.host = Residency(e, k, policy), Residency(e, k, policy)
        if cold:
            self.ref.invalidate(range(k))
            self.host.invalidate(range(k))
        self.state = DeviceResidency(self.host, torch.device("cpu"))
        self.misses = 0

    def _plan(self, ids: torch.Tensor, ranks, wave: int) -> None:
        fn = plan_step_triton if self.impl == "triton" else plan_step_torch
        fn(ids, self.state.state, self.state.step_plan, pad=-1, ranks=ranks, wave=wave)

    def device_step(self, ids: list[int]) -> None:
        """One device-planned step, in as many device waves as a capture would run."""
        flat = torch.tensor(ids, dtype=torch.int64)
        n = max(1, -(-min(self.e, flat.numel()) // self.k))
        ranks = self.state.ranks(flat) if n > 1 else None
        waves = plan_waves(self.ref, sorted({i for i in ids if 0 <= i < self.e}))
        assert len(waves) <= n
        for w in range(n):
            self._plan(flat, ranks, w)
            loads = list(waves[w].loads) if w < len(waves) else []
            plan = self.state.step_plan
            got = int(plan.count)
            assert list(zip(plan.experts.tolist()[:got], plan.slots.tolist()[:got])) == loads
            self.misses += got
        assert self.state.table.tolist() == self.ref.table()

    def host_step(self, experts: list[int], wave_size: int | None = None, admit: int | None = None) -> None:
        self.state.pull(self.host)
        got = plan_waves(self.host, experts, wave_size, admit)
        self.state.push(self.host)
        assert got == plan_waves(self.ref, experts, wave_size, admit)
        assert self.state.table.tolist() == self.ref.table()
        self.misses += sum(len(w.loads) for w in got)

    def forget(self, slots: list[int]) -> None:
        self.state.pull(self.host)
        self.host.invalidate(slots)
        self.state.push(self.host)
        self.ref.invalidate(slots)
        assert self.state.table.tolist() == self.ref.table()


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_device_steps_interleaved_with_host_steps(data):
    e = data.draw(st.integers(1, 20))
    k = data.draw(st.integers(1, e))
    run = Interleaved(e, k, data.draw(ANY_RULE), cold=data.draw(st.booleans()))
    for routed in data.draw(steps_of(e, data.draw(st.integers(1, 30)), 3 * e)):
        kind = data.draw(st.sampled_from(["device", "device", "host", "forget"]))
        if kind == "device":  # one wave, or several (a captured batch), some entries padding
            pads = data.draw(st.lists(st.sampled_from([-1, -3, e, e + 5]), max_size=k))
            ids = (routed + pads)[: data.draw(st.sampled_from([k, 3 * k]))]
            run.device_step(data.draw(st.permutations(ids)))
        elif kind == "host":
            run.host_step(routed, data.draw(st.sampled_from([None, max(1, k // 2)])),
                          data.draw(st.sampled_from([None, 1, max(1, k // 2)])))
        else:
            run.forget(data.draw(st.lists(st.integers(0, k - 1), max_size=k, unique=True)))


def test_long_random_interleaving():
    rng = random.Random(7)
    for half_life in (0, 7, 1024):
        run = Interleaved(64, 16, policy_of(half_life))
        hot = rng.sample(range(64), 12)
        for _ in range(1500):
            pick = lambda n: [rng.choice(hot) if rng.random() < 0.7 else rng.randrange(64) for _ in range(n)]  # noqa: B023 called within this iteration
            r = rng.random()
            if r < 0.75:
                run.device_step((pick(rng.randint(0, 40)) + [-1, 64])[: rng.choice([16, 40])])
            elif r < 0.97:
                run.host_step(pick(rng.randint(1, 60)), rng.choice([None, 8]), rng.choice([None, 4]))
            else:
                run.forget(rng.sample(range(16), 2))


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_triton_planner_interleaved_with_host_steps(monkeypatch):
    """The kernel a CUDA graph captures, run by the Triton interpreter: every policy, waves of one
    and of several device steps, host steps in between (decay every 3 waves included)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = random.Random(11)
    for i, policy in enumerate(RULES):
        run = Interleaved(16, 5, policy, cold=i % 2 == 1, impl="triton")
        hot = rng.sample(range(16), 6)
        for _ in range(14):
            pick = lambda n: [rng.choice(hot) if rng.random() < 0.7 else rng.randrange(16) for _ in range(n)]  # noqa: B023 called within this iteration
            if rng.random() < 0.7:
                run.device_step((pick(rng.randint(0, 12)) + [-1, 16])[: rng.choice([5, 12])])
            else:
                run.host_step(pick(rng.randint(1, 14)), rng.choice([None, 2]))


@functools.cache
def real_head(spec: str, steps: int = 100, layers: int = 2) -> traces.Trace:
    t = load_real(spec)
    return traces.Trace(t.name, t.num_experts, t.top_k, [layer[:steps] for layer in t.layers[:layers]])


@needs_traces
@pytest.mark.parametrize("spec", list(REAL_TRACES))
def test_real_traces_plan_the_same_on_host_and_device(spec):
    """Device steps where a step fits K (two in three), host steps elsewhere: every decision equals
    the all-host replay's, and so do the misses."""
    trace = real_head(spec)
    k = traces.resolve_k("0.5", trace.num_experts)
    for policy in (*RULES, policy_of(3)):
        misses = 0
        for steps in trace.layers:
            run = Interleaved(trace.num_experts, k, policy, cold=True)
            for t, experts in enumerate(steps):
                if len(experts) <= k and t % 3:
                    run.device_step(list(experts))
                else:
                    run.host_step(list(experts))
            misses += run.misses
        assert misses == traces.replay(trace, k, policy).misses


# -- overlap guarantee ---------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(st.data())
def test_no_wave_evicts_the_wave_before_it(data):
    """With waves of at most K // 2 (at most admit // 2 under admission), under any policy."""
    e = data.draw(st.integers(4, 24))
    k = data.draw(st.integers(2, e))
    admit = data.draw(st.one_of(st.none(), st.integers(2, k)))
    res = Residency(e, k, policy_of(data.draw(st.sampled_from(HALF_LIVES))))
    for routed in data.draw(steps_of(e, data.draw(st.integers(1, 12)), 3 * e)):
        waves = plan_waves(res, routed, (admit or k) // 2, admit)
        for before, wave in zip(waves, waves[1:]):
            assert not {s for _, s in wave.loads} & set(before.slots)
        check_residency(res)


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_lru_decisions_do_not_depend_on_that_guarantee(data):
    """LRU never prefers the previous wave's slots anyway: waves of K // 2 match ``RefLRU``."""
    e = data.draw(st.integers(2, 24))
    k = data.draw(st.integers(2, e))
    res, ref = Residency(e, k), RefLRU(e, k)
    for routed in data.draw(steps_of(e, data.draw(st.integers(1, 12)), 3 * e)):
        waves = plan_waves(res, routed, k // 2)
        assert [(list(w.experts), list(w.loads)) for w in waves] == ref.step(routed, k // 2)
        assert_matches_ref(res, ref)


# -- prefill admission ---------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(st.data())
def test_admission_caps_the_slots_a_prefill_evicts(data):
    e = data.draw(st.integers(3, 24))
    k = data.draw(st.integers(2, e - 1))
    admit = data.draw(st.integers(1, k))
    res = Residency(e, k, policy_of(data.draw(st.sampled_from(HALF_LIVES))))
    for routed in data.draw(steps_of(e, data.draw(st.integers(0, 6)), k)):
        plan_waves(res, routed)
    if data.draw(st.booleans()):
        res.invalidate(data.draw(st.lists(st.integers(0, k - 1), max_size=k, unique=True)))
    prefill = data.draw(st.lists(st.integers(0, e - 1), min_size=1, max_size=3 * e))
    wave_size = data.draw(st.sampled_from([None, max(1, k // 2)]))
    before = state_of(res)
    distinct = sorted(set(prefill))
    plain = Residency(e, k, res.policy)
    plain.load_table(res.table())
    waves = plan_waves(res, prefill, wave_size, admit)
    assert sorted(x for w in waves for x in w.experts) == distinct
    assert all(1 <= len(w.experts) <= (wave_size or k) for w in waves)
    assert sum(w.hits for w in waves) == sum(before["expert_slot"][x] != EMPTY for x in distinct)
    check_residency(res)
    if len(distinct) <= k:  # one wave at most: admission does not apply
        assert waves == plan_waves(plain, prefill, wave_size) and res.table() == plain.table()
        return
    loaded = {s for w in waves for _, s in w.loads}
    evicted = {s for s in loaded if before["slot_expert"][s] != EMPTY}
    assert len(evicted) <= admit
    assert all(res.slot_expert[s] == before["slot_expert"][s] for s in range(k) if s not in loaded)
    assert all(res.last_use[s] == 0 for s in loaded)
    others = [s for s in range(k) if before["slot_expert"][s] not in set(distinct) | {EMPTY}]
    if len(evicted) == admit <= len(others):  # the first `admit` of those in eviction order
        ranked = sorted(others, key=lambda s: (before["score"][before["slot_expert"][s]], before["last_use"][s], s))
        assert evicted == set(ranked[:admit])


def test_admission_keeps_the_decode_working_set():
    """E=16, K=4, LRU: a prefill of 8 new experts flushes the decode set {0..3} without admission;
    with admit=1 it rotates through one slot, which the next decode step evicts first (stamp 0:
    without the restamp it would be the newest, and expert 3 would go)."""
    for admit, resident_after, next_loads in ((None, [8, 9, 10, 11], ((1, 0), (2, 1), (12, 2))),
                                              (1, [11, 1, 2, 3], ((12, 0),))):
        res = Residency(16, 4)
        plan_waves(res, [0, 1, 2, 3])
        plan_waves(res, [1, 2, 3])  # slot 0 (expert 0) is now the oldest
        waves = plan_waves(res, range(4, 12), admit=admit)
        assert len(waves) == (2 if admit is None else 8)
        assert res.slot_expert == resident_after
        [w] = plan_waves(res, [1, 2, 12])
        assert w.loads == next_loads
