"""Tests of moepage.kernels: planner and gather against the host rule and plain copies.

CPU tests run the Triton kernels under the interpreter. ``triton.jit`` reads TRITON_INTERPRET
when it decorates (not at launch), and triton decorates its own library at import; the kernels
modules decorate lazily per mode and route library calls through the interpreter, so a fixture
that sets the variable is enough even when other tests imported triton first.
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers.kernels import (  # noqa: E402
    ROW_SHAPES,
    RULES,
    assert_bytes_equal,
    check_out,
    check_resident_rows,
    check_step,
    expected_slots,
    gather_trials,
    make_tensors,
    multiwave_trial,
    new_state,
    planner_cases,
    planner_trial,
    random_plan,
    rank_cases,
    reference_step,
    run_plan,
)
from moepage.kernels import gather as G
from moepage.kernels import planner as P
from moepage.kernels import ranks as R

needs_triton = pytest.mark.skipif(not P.triton_available(), reason="needs triton")


# -- planner -------------------------------------------------------------------------------------


def test_planner_torch_matches_reference() -> None:
    rng = random.Random(1)
    for i, (e, k, top_k) in enumerate(planner_cases(1, 60)):
        planner_trial(P.plan_step_torch, rng, e, k, top_k, steps=12, device="cpu", policy=RULES[i % len(RULES)])


@needs_triton
def test_planner_triton_matches_reference(interpret: None) -> None:
    # The interpreter runs tl.sort element by element (K log^2 K steps): fewer steps for large K.
    rng = random.Random(2)
    for i, (e, k, top_k) in enumerate(planner_cases(2, 30)):
        planner_trial(P.plan_step_triton, rng, e, k, top_k, steps=8 if k <= 32 else 3, device="cpu",
                      policy=RULES[i % len(RULES)])


@needs_triton
def test_planner_triton_largest(interpret: None) -> None:
    planner_trial(P.plan_step_triton, random.Random(3), 512, 512, 8, steps=2, device="cpu")


def test_planner_torch_multiwave_matches_plan_waves() -> None:
    rng = random.Random(21)
    for i, (e, k, top_k) in enumerate(planner_cases(21, 40)):
        multiwave_trial(P.plan_step_torch, rng, e, k, top_k, steps=8, policy=RULES[i % len(RULES)])


@needs_triton
def test_planner_triton_multiwave_matches_plan_waves(interpret: None) -> None:
    rng = random.Random(22)
    for i, (e, k, top_k) in enumerate([(16, 4, 2), (32, 8, 8), (8, 3, 1), (64, 16, 4)] * 2):
        multiwave_trial(P.plan_step_triton, rng, e, k, top_k, steps=4, policy=RULES[i % len(RULES)])


@needs_triton
def test_planner_triton_multiwave_with_triton_ranks(interpret: None) -> None:
    rng = random.Random(23)
    for i, (e, k, top_k) in enumerate([(16, 4, 2), (40, 8, 8), (8, 3, 1)]):
        multiwave_trial(P.plan_step_triton, rng, e, k, top_k, steps=4, policy=RULES[i % len(RULES)],
                        ranks_fn=R.step_ranks_triton)


def test_planner_torch_overlapped_waves_match_plan_waves() -> None:
    """Waves of K // 2 (overlapped): each evicts the previous wave's slots last, as the host rule does."""
    rng = random.Random(25)
    for i, (e, k, top_k) in enumerate(planner_cases(25, 40)):
        if k >= 2:
            multiwave_trial(P.plan_step_torch, rng, e, k, top_k, steps=8, policy=RULES[i % len(RULES)], width=k // 2)


@needs_triton
def test_planner_triton_overlapped_waves_match_plan_waves(interpret: None) -> None:
    # Under LRU the previous wave's slots are the newest, evicted last anyway: frequency policies tell the rule apart.
    rng = random.Random(26)
    cases = [(16, 4, 2), (32, 8, 8), (8, 3, 1), (64, 16, 4)]
    for i, policy in enumerate(RULES):  # every rule, the shapes in turn
        e, k, top_k = cases[i % len(cases)]
        multiwave_trial(P.plan_step_triton, rng, e, k, top_k, steps=6, policy=policy, width=k // 2,
                        ranks_fn=R.step_ranks_triton)


def test_planner_width_is_checked() -> None:
    st = new_state(8, 4)
    with pytest.raises(ValueError, match=r"a wave's width must be in 1..K=4, got 5"):
        run_plan(P.plan_step_torch, torch.tensor([[1, 2]]), st, width=5)


@needs_triton
def test_step_ranks_triton_matches_torch(interpret: None) -> None:
    for ids, expert_slot in rank_cases(random.Random(24)):
        want = R.step_ranks_torch(ids, expert_slot)
        got = R.step_ranks_triton(ids, expert_slot)
        assert got.dtype == want.dtype and got.shape == ids.shape
        assert torch.equal(got, want), (ids.tolist(), expert_slot.tolist())


def test_step_ranks_order_is_resident_then_missing_by_id() -> None:
    expert_slot = torch.tensor([-1, 0, -1, 1, -1])  # experts 1 and 3 resident
    ids = torch.tensor([[4, 3], [0, 1], [3, -1], [5, 2]])
    assert R.step_ranks(ids, expert_slot).tolist() == [[4, 1], [2, 0], [1, -1], [-1, 3]]


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_planner_rejects_more_entries_than_slots(impl: str, interpret: None) -> None:
    fn = P.plan_step_torch if impl == "torch" else P.plan_step_triton
    with pytest.raises(ValueError):
        run_plan(fn, torch.zeros(3, 2, dtype=torch.int64), new_state(8, 4))


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_planner_id_dtypes(impl: str, interpret: None) -> None:
    fn = P.plan_step_torch if impl == "torch" else P.plan_step_triton
    cases = [(torch.uint8, [3, 200, 9, 3]), (torch.int8, [-128, 7, 2, 127]), (torch.int64, [2**40, 5, -(2**40), 6])]
    for dtype, vals in cases:
        st = new_state(10, 4)
        ids = torch.tensor(vals, dtype=dtype).reshape(2, 2)
        ref, loads, hits = reference_step(st, ids, 10, 4)
        out = torch.empty_like(ids)
        run_plan(fn, ids, st, out=out, pad=4)  # a pad every dtype holds
        check_step(st, ref, loads, [1, 1, hits, len(loads)])
        check_out(out, ids, ref, {i for i in ids.flatten().tolist() if 0 <= i < 10}, 4)


def test_plan_step_dispatches_to_torch_on_cpu() -> None:
    st = new_state(8, 4)
    ids = torch.tensor([[5, 1]])
    ref, loads, hits = reference_step(st, ids, 8, 4)
    run_plan(P.plan_step, ids, st)
    check_step(st, ref, loads, [1, 1, hits, len(loads)])


# -- gather --------------------------------------------------------------------------------------


@needs_triton
def test_gather_triton_rows_of_every_size(interpret: None) -> None:
    gather_trials("triton", "cpu", pin=False)


def test_gather_torch_rows_of_every_size() -> None:
    gather_trials("torch", "cpu", pin=False)


def _gather_once(impl: str, specs: list, e: int, k: int, count: int, seed: int) -> None:
    """One random plan of ``count`` rows gathered by ``impl`` into ``k`` slots of each ``specs`` tensor; checked."""
    hosts, slots = make_tensors(e, k, specs)
    pe, ps, pc = random_plan(random.Random(seed), e, k, count, "cpu")
    want = expected_slots(hosts, slots, pe, ps, count)
    if impl == "triton":
        G.gather_rows(G.PointerTable.from_tensors(hosts, slots), pe, ps, pc, count)
    else:
        G.gather_rows_torch(hosts, slots, pe, ps, pc)
    assert_bytes_equal(slots, want)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_gather_large_rows(impl: str, interpret: None) -> None:
    # Rows of a few MB span many programs; the odd size leaves a byte tail in the last one.
    _gather_once(impl, [(((3 << 20) + 16,), torch.uint8), (((1 << 20) + 3,), torch.uint8)], 4, 3, 2, seed=6)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_gather_fp8_rows(impl: str, interpret: None) -> None:
    # Block-FP8 experts page their FP8 weights beside float32 scales (torch's CPU index ops have no FP8 kernels).
    specs = [((8, 16), torch.float8_e4m3fn), ((4,), torch.float8_e5m2), ((2, 2), torch.float32)]
    _gather_once(impl, specs, 6, 3, 3, seed=8)


def test_pointer_table_rejects_mismatch() -> None:
    with pytest.raises(ValueError):
        G.PointerTable.from_tensors([torch.zeros(4, 3)], [torch.zeros(2, 4)])
    with pytest.raises(ValueError):
        G.PointerTable.from_tensors([torch.zeros(4, 3)], [torch.zeros(2, 3, dtype=torch.float16)])


@needs_triton
def test_plan_then_gather_keeps_slots_filled(interpret: None) -> None:
    # End to end on CPU: after each step every slot holds the host row of its expert.
    e, k, top_k = 16, 6, 2
    st = new_state(e, k)
    hosts, slots = make_tensors(e, k, ROW_SHAPES[:4] + ROW_SHAPES[5:6])
    for h, s in zip(hosts, slots):
        s.copy_(h[:k])
    table = G.PointerTable.from_tensors(hosts, slots)
    rng = random.Random(7)
    for _ in range(8):
        ids = torch.tensor([rng.randrange(-1, e) for _ in range(k)]).reshape(-1, top_k)
        run_plan(P.plan_step_triton, ids, st)
        G.gather_rows(table, st["plan_experts"], st["plan_slots"], st["plan_count"], k)
        check_resident_rows(hosts, slots, st["slot_expert"])


# -- GPU (compiled kernels, no interpreter) ----------------------------------------------------


