"""Coded host rows on CUDA: the compiled decode kernel against the rows (pinned host rows read
under UVA, captured in a graph and replayed with other counts), and the serving flow of a
compressed store (host-planned decode launches, device-planned gathers, replays) equal to unpaged."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import moepage
from helpers.flows import REPLAYS, ROUNDS, rounds
from helpers.kernels import CODED_ALIGNED, CODED_UNALIGNED, assert_bytes_equal, coded_layer, expected_decoded
from moepage.kernels import unpack as D
from moepage.toy import ToyExperts

gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("shapes", [CODED_ALIGNED, CODED_UNALIGNED], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
@pytest.mark.usefixtures("compiled")
def test_gpu_decode_kernel_matches_rows_eager_and_captured(shapes, mark) -> None:
    e, k = 9, 6
    sources, hosts, slots, codes = coded_layer(e, k, shapes, seed=7, device="cuda", pin=True)
    table = D.CodedTable(hosts=hosts, slots=slots, codes=codes)
    rng = random.Random(8)
    i32 = dict(dtype=torch.int32, device="cuda")
    pe, ps, pc = (torch.full((k,), -1, **i32), torch.full((k,), -1, **i32), torch.zeros(1, **i32))
    D.gather_coded(table, pe, ps, pc, k)  # warm up (compile) before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        D.gather_coded(table, pe, ps, pc, k)
    for count in (k, 0, 1, 4, 2):
        experts = rng.sample(range(e), count) + [-1] * (k - count)
        targets = rng.sample(range(k), count) + [-1] * (k - count)
        pe.copy_(torch.tensor(experts, **i32))
        ps.copy_(torch.tensor(targets, **i32))
        pc.fill_(count)
        want = expected_decoded(sources, slots, pe.cpu(), ps.cpu(), count)
        graph.replay()
        torch.cuda.synchronize()
        assert_bytes_equal(slots, want)


@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_gpu_compressed_serving_flow_equals_unpaged(mark) -> None:
    pytest.importorskip("cuda.bindings", reason="needs cuda-python (pip install 'moepage[cuda]')")
    torch.manual_seed(4)
    ref = ToyExperts(32, 256, 128, 4, "batched_mm").to("cuda", torch.bfloat16)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=7, backend="cuda", compress=True, policy="lru")
    held = next(iter(moepage.host_bytes(paged).values()))
    assert held.coded == ("gate_up_proj", "down_proj") and held.ratio > 1.3
    gen = torch.Generator().manual_seed(5)
    assert rounds(paged, ref, 32, 4, 256, torch.bfloat16, gen, capture=True) == ROUNDS * REPLAYS * 2


@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_gpu_compressed_torch_store_decodes_on_the_device(mark) -> None:
    """The torch store on CUDA plans on the host: each coded row is copied in, then decoded by torch."""
    torch.manual_seed(6)
    ref = ToyExperts(32, 256, 128, 4, "batched_mm").to("cuda", torch.bfloat16)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=7, backend="torch", compress=True, verify=True)
    for t in (1, 9, 64, 2, 33):
        x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(32, device="cuda")[:4] for _ in range(t)])
        w = torch.rand(t, 4, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(paged(x, idx, w), ref(x, idx, w))
    assert moepage.stats(paged).total.misses > 0


@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_rows_coded_on_the_gpu_equal_rows_coded_on_the_cpu(mark) -> None:
    """The encoder on the GPU (where wrap and the engines code rows as they load) writes the CPU's bytes: the same
    table and capacity, the same coded rows, escapes included, in any chunking."""
    from moepage import compress as C

    gen = torch.Generator().manual_seed(11)
    rows = (torch.randn(13, 96, 40, generator=gen) * 0.05).to(torch.bfloat16)
    rows.view(-1)[:: 997] = torch.tensor(3.0e4, dtype=torch.bfloat16)  # rare exponents: escapes
    cpu = C.plan_code(rows, chunk=5)
    gpu_plan = C.plan_code(rows.to("cuda"), chunk=5, device="cuda")
    assert cpu == gpu_plan and cpu.code is not None and cpu.max_escapes > 0
    want = C.encode_rows(rows, cpu.code)
    got = torch.cat([C.encode_rows(rows[i : i + 3], cpu.code, "cuda") for i in range(0, 13, 3)])
    assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
    assert torch.equal(C.decode_rows(got, cpu.code).cpu().view(torch.int16), rows.view(torch.int16))
