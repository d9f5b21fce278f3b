"""The planner and gather kernels compiled on CUDA: against the host rule, and captured once in a
graph then replayed."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.kernels import (
    advance,
    assert_bytes_equal,
    check_resident_rows,
    check_step,
    expected_slots,
    gather_trials,
    make_tensors,
    new_state,
    planner_cases,
    planner_trial,
    random_ids,
    random_plan,
    rank_cases,
    reference_step,
    run_plan,
)
from moepage.kernels import gather as G
from moepage.kernels import planner as P
from moepage.kernels import ranks as R


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.usefixtures("compiled")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_planner_matches_reference(impl: str) -> None:
    fn = P.plan_step_triton if impl == "triton" else P.plan_step_torch
    rng = random.Random(11)
    for e, k, top_k in planner_cases(11, 24) + [(512, 512, 8), (512, 200, 8)]:
        planner_trial(fn, rng, e, k, top_k, steps=10, device="cuda")


@pytest.mark.usefixtures("compiled")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_step_ranks_triton_matches_torch_eager_and_captured() -> None:
    cases = [(ids.cuda(), es.cuda()) for ids, es in rank_cases(random.Random(14))]
    for ids, expert_slot in cases:
        assert torch.equal(R.step_ranks_triton(ids, expert_slot), R.step_ranks_torch(ids, expert_slot))
    ids, expert_slot = cases[6]  # 128 experts, 256 entries: a 32-token top-8 decode step
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = R.step_ranks(ids, expert_slot)
    replays = 0
    for fresh_ids, fresh_slots in rank_cases(random.Random(15)):
        if fresh_ids.shape == ids.shape and fresh_slots.shape == expert_slot.shape:
            ids.copy_(fresh_ids)
            expert_slot.copy_(fresh_slots)
            graph.replay()
            assert torch.equal(out, R.step_ranks_torch(ids, expert_slot))
            replays += 1
    assert replays == 3


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.usefixtures("compiled")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_gather_matches_reference(impl: str) -> None:
    gather_trials(impl, "cuda", pin=impl == "triton")
    specs = [(((3 << 20) + 16,), torch.uint8), (((1 << 20) + 3,), torch.uint8), ((4096, 7), torch.bfloat16)]
    hosts, slots = make_tensors(5, 4, specs, "cuda", pin=impl == "triton")
    pe, ps, pc = random_plan(random.Random(12), 5, 4, 3, "cuda")
    want = expected_slots(hosts, slots, pe, ps, 3)
    if impl == "triton":
        G.gather_rows(G.PointerTable.from_tensors(hosts, slots), pe, ps, pc, 4)
    else:
        G.gather_rows_torch([h.cuda() for h in hosts], slots, pe, ps, pc)
    assert_bytes_equal(slots, want)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.usefixtures("compiled")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graph_replay(impl: str) -> None:
    """plan + gather captured once, replayed 200 times on fresh ids in a static buffer."""
    e, k, top_k, t = 64, 16, 4, 4
    st = new_state(e, k, "cuda")
    fresh = {name: v.clone() for name, v in st.items() if isinstance(v, torch.Tensor)}
    specs = [((96,), torch.bfloat16), ((7,), torch.uint8), ((64, 3), torch.float32)]
    hosts, slots = make_tensors(e, k, specs, "cuda", pin=impl == "triton")
    dev_hosts = [h.cuda() for h in hosts]
    table = G.PointerTable.from_tensors(hosts, slots) if impl == "triton" else None
    ids = torch.full((t, top_k), -1, dtype=torch.int64, device="cuda")

    def step() -> None:
        if impl == "triton":
            run_plan(P.plan_step_triton, ids, st)
            G.gather_rows(table, st["plan_experts"], st["plan_slots"], st["plan_count"], t * top_k)
        else:
            run_plan(P.plan_step_torch, ids, st)
            G.gather_rows_torch(dev_hosts, slots, st["plan_experts"], st["plan_slots"], st["plan_count"])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles the kernels outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    for name, v in fresh.items():
        st[name].copy_(v)
    for h, s in zip(hosts, slots):
        s.copy_(h[:k])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    rng = random.Random(13)
    hot = rng.sample(range(e), 12)
    counters = [0, 0, 0, 0]
    for _ in range(200):
        new = random_ids(rng, e, k, top_k, hot).to(torch.int64)
        new = torch.cat([new, torch.full((t - new.shape[0], top_k), -1, dtype=torch.int64)])
        ref, loads, hits = reference_step(st, new, e, k)
        ids.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        counters = advance(counters, True, hits, loads)
        check_step(st, ref, loads, counters)
        check_resident_rows(hosts, slots, st["slot_expert"])
