"""moepage.kernels.unpack: the Triton decode of coded rows into slots (CPU: under the
interpreter) equals the torch reference decoder and the original rows, bit for bit; entries past
the plan's count and other slots stay as they were."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.kernels import CODED_ALIGNED as ALIGNED
from helpers.kernels import CODED_UNALIGNED as UNALIGNED
from helpers.kernels import assert_bytes_equal, coded_layer, coded_rows, expected_decoded, random_plan
from moepage import compress as C
from moepage.kernels import gather as G
from moepage.kernels import planner as P
from moepage.kernels import unpack as D

needs_triton = pytest.mark.skipif(not P.triton_available(), reason="needs triton")


@needs_triton
@pytest.mark.parametrize("shapes", [ALIGNED, UNALIGNED], ids=["aligned", "unaligned"])
def test_decode_kernel_matches_the_rows_and_the_torch_reference(shapes, interpret: None) -> None:
    e, k = 7, 4
    sources, hosts, slots, codes = coded_layer(e, k, shapes, seed=len(shapes[0]))
    table = D.CodedTable(hosts=hosts, slots=slots, codes=codes)
    assert table.aligned == (shapes is ALIGNED)
    rng = random.Random(3)
    for count in (k, 0, 1, 3):
        pe, ps, pc = random_plan(rng, e, k, count, "cpu")
        want = expected_decoded(sources, slots, pe, ps, count)
        torch_slots = [s.clone() for s in slots]
        decoders = [lambda rows, c=c: C.decode_rows(rows, c) for c in codes]
        G.gather_rows_torch(hosts, torch_slots, pe, ps, pc, decoders=decoders)
        D.gather_coded(table, pe, ps, pc, max_count=k if count in (0, k) else max(count, 2))
        assert_bytes_equal(slots, want)
        assert_bytes_equal(torch_slots, want)


@needs_triton
def test_decode_kernel_patches_every_escape_of_a_row_at_the_cap(interpret: None) -> None:
    n = 64 * 300
    rows, code = coded_rows(3, (n,), seed=11, escapes=False)
    words = rows.view(torch.int16)
    at = torch.randperm(n, generator=torch.Generator().manual_seed(1))[: n // 64]
    words[1, at] = torch.tensor(0x7F80, dtype=torch.int16)  # as many infinities as the cap allows
    words[2, -1] = torch.tensor(0x0001, dtype=torch.int16)
    code = C.plan_code(rows, chunk=3).code
    assert code is not None and code.layout.capacity >= n // 64 > D._EBLOCK  # several patch iterations
    slots = torch.zeros(2, n, dtype=torch.bfloat16)
    plan = [torch.tensor(v, dtype=torch.int32) for v in ([1, 2], [0, 1], [2])]
    D.gather_coded(D.CodedTable(hosts=[C.encode_rows(rows, code)], slots=[slots], codes=[code]), *plan, max_count=2)
    assert torch.equal(slots.view(torch.int16), rows[1:].view(torch.int16))  # experts 1, 2 into slots 0, 1


def test_coded_table_refuses_what_does_not_match() -> None:
    rows, code = coded_rows(3, (64, 8), seed=2)
    packed = C.encode_rows(rows, code)
    slots = torch.zeros(2, 64, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="uint8"):
        D.CodedTable(hosts=[rows], slots=[slots], codes=[code])
    with pytest.raises(ValueError, match="bf16 rows"):
        D.CodedTable(hosts=[packed], slots=[slots.float()], codes=[code])
    with pytest.raises(ValueError, match="one slot tensor"):
        D.CodedTable(hosts=[packed], slots=[], codes=[code])
