"""moepage.compress: the exponent code with an exception list round-trips bf16 rows bit for bit
(random, trained, adversarial), lays rows out as documented, and keeps raw what it cannot shrink."""

from __future__ import annotations

import math

import pytest
import torch

from moepage import compress as C

SPECIALS = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x807F, 0x0080, 0x7F7F, 0xFF7F]
# +0, -0, +inf, -inf, quiet NaN, a negative NaN with payload, a signalling NaN, the smallest denormal, a negative
# denormal, the smallest normal, the largest finite, its negative


def from_bits(bits) -> torch.Tensor:
    """bf16 rows whose 16 bits are ``bits`` (ints 0..65535, any shape)."""
    t = torch.as_tensor(bits, dtype=torch.int32)
    return C._to_int16(t).view(torch.bfloat16)


def bits_of(rows: torch.Tensor) -> torch.Tensor:
    return rows.contiguous().view(torch.int16)


def patterned(rows: int, n: int, exponents, seed: int = 0) -> torch.Tensor:
    """Rows of ``n`` weights with random sign and mantissa, exponents drawn from ``exponents``."""
    g = torch.Generator().manual_seed(seed)
    exps = torch.as_tensor(exponents)[torch.randint(0, len(exponents), (rows, n), generator=g)]
    sm = torch.randint(0, 256, (rows, n), generator=g)
    return from_bits(((sm & 0x80) << 8) | (exps << 7) | (sm & 0x7F))


def round_trip(rows: torch.Tensor, chunk: int = 3) -> C.Coding:
    coding = C.plan_code(rows, chunk=chunk)
    assert coding.code is not None, coding.why
    packed = C.encode_rows(rows, coding.code)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (rows.shape[0], coding.code.nbytes)
    assert torch.equal(bits_of(C.decode_rows(packed, coding.code)), bits_of(rows))
    assert torch.equal(C.encode_rows(rows, coding.code), packed)  # deterministic: gaps and unused entries zero
    return coding


def fields(packed: torch.Tensor, code: C.TensorCode, row: int) -> tuple[int, list[int], list[int]]:
    lay = code.layout
    count = int(packed[row, lay.count : lay.count + 4].view(torch.int32))
    idx = packed[row, lay.indices : lay.values].view(torch.int32).tolist()
    val = (packed[row, lay.values : lay.values + 2 * lay.capacity].view(torch.int16).int() & 0xFFFF).tolist()
    return count, idx, val


@pytest.mark.parametrize("shape", [(64, 32), (33, 67), (5001,), (2, 3, 700)])
def test_random_init_rows_round_trip(shape) -> None:
    g = torch.Generator().manual_seed(len(shape))
    rows = (torch.randn(7, *shape, generator=g) * 0.02).to(torch.bfloat16)
    coding = round_trip(rows)
    assert coding.code.shape == shape and coding.code.weights == math.prod(shape)


def test_trained_rows_round_trip_at_about_four_thirds() -> None:
    from safetensors.torch import load_file

    from helpers.tiny import CKPT

    stacks: dict[str, dict[int, torch.Tensor]] = {}  # per layer and projection, its experts' rows
    for key, value in load_file(str(CKPT / "model.safetensors")).items():
        if ".experts." in key:
            head, rest = key.split(".experts.")
            expert, proj = rest.split(".", 1)
            stacks.setdefault(f"{head}.{proj}", {})[int(expert)] = value
    tensors = {k: torch.stack([v[e] for e in sorted(v)]) for k, v in stacks.items()}
    assert len(tensors) == 12 and all(t.shape[0] == 32 for t in tensors.values())
    raw = held = 0
    for rows in tensors.values():
        coding = round_trip(rows, chunk=8)
        raw += rows.numel() * 2
        held += rows.shape[0] * coding.code.nbytes
    assert 1.28 < raw / held < 4 / 3


def test_layout_sections_are_aligned_and_sized() -> None:
    for n, cap in [(1, 0), (7, 8), (2048, 0), (2049, 16), (1 << 20, 256)]:
        lay = C.RowLayout(weights=n, capacity=cap)
        assert lay.codes >= n and lay.count >= lay.codes + (n + 1) // 2
        assert lay.values == lay.indices + 4 * cap and lay.nbytes >= lay.values + 2 * cap
        assert all(x % 16 == 0 for x in (lay.codes, lay.count, lay.indices, lay.values, lay.nbytes))
        assert lay.nbytes - (lay.values + 2 * cap) < 16


def test_fifteen_exponents_code_without_escapes() -> None:
    rows = patterned(4, 999, list(range(100, 115)))
    coding = round_trip(rows)
    assert coding.max_escapes == 0 and coding.code.layout.capacity == 0
    assert sorted(coding.code.table) == list(range(100, 115))


def test_a_sixteenth_exponent_escapes_the_rarest() -> None:
    rows = patterned(3, 1000, list(range(100, 115)))
    rows.view(torch.int16)[1, 17] = from_bits(50 << 7).view(torch.int16)  # one weight, a 16th exponent
    coding = round_trip(rows)
    assert 50 not in coding.code.table and coding.max_escapes == 1 and coding.code.layout.capacity == 8
    packed = C.encode_rows(rows, coding.code)
    assert fields(packed, coding.code, 1) == (1, [17] + [0] * 7, [50 << 7] + [0] * 7)
    assert fields(packed, coding.code, 0)[0] == 0  # a row with none beside one with some


def test_every_exponent_present_still_codes_bit_exactly() -> None:
    # 256 exponents over the tensor, 241 of them rare: each row holds every exponent once beside common ones.
    n = 64 * 256
    rows = patterned(3, n, list(range(110, 125)), seed=3)
    words = rows.view(torch.int16)
    for r in range(3):
        at = torch.randperm(n, generator=torch.Generator().manual_seed(r))[:256]
        words[r, at] = from_bits(torch.arange(256) << 7 | (r * 37 % 128)).view(torch.int16)
    coding = round_trip(rows)
    assert coding.max_escapes == 241 and coding.code.layout.capacity == 248


def test_special_values_and_escapes_at_row_ends() -> None:
    n = 64 * 12 + 5  # odd: the last code byte holds one code
    rows = patterned(4, n, list(range(110, 125)), seed=4)  # 15 exponents: every special one escapes
    words = rows.view(torch.int16)
    specials = from_bits(SPECIALS).view(torch.int16)
    words[0, : len(SPECIALS)] = specials
    words[1, -len(SPECIALS) :] = specials
    words[2, 0] = specials[2]  # escapes at both ends of a row
    words[2, -1] = specials[4]
    coding = round_trip(rows)
    packed = C.encode_rows(rows, coding.code)
    count, idx, _ = fields(packed, coding.code, 2)
    assert count == 2 and idx[:2] == [0, n - 1]
    assert fields(packed, coding.code, 0)[:2] == (len(SPECIALS), list(range(len(SPECIALS))) + [0] * 4)
    assert fields(packed, coding.code, 1)[1][: len(SPECIALS)] == list(range(n - len(SPECIALS), n))
    assert fields(packed, coding.code, 3)[0] == 0


def test_a_row_at_the_cap_codes_one_past_it_stays_raw() -> None:
    n = 64 * 40
    rows = patterned(2, n, list(range(100, 115)), seed=5)
    words = rows.view(torch.int16)
    words[1, : n // 64] = from_bits(torch.full((n // 64,), 7 << 7)).view(torch.int16)
    at_cap = round_trip(rows)
    assert at_cap.max_escapes == n // 64
    words[0, -(n // 64 + 1) :] = from_bits(torch.full((n // 64 + 1,), 9 << 7)).view(torch.int16)
    over = C.plan_code(rows, chunk=1)
    assert over.code is None and over.max_escapes == n // 64 + 1
    assert "row 0 escapes 41" in over.why and "1/64" in over.why


def test_tiny_and_empty_rows_stay_raw() -> None:
    tiny = C.plan_code(torch.ones(4, 7, dtype=torch.bfloat16), chunk=2)
    assert tiny.code is None and "not fewer than the raw 14" in tiny.why
    assert C.plan_code(torch.ones(4, 0, dtype=torch.bfloat16), chunk=2).code is None


def test_rows_over_the_capacity_are_refused() -> None:
    rows = patterned(2, 640, list(range(100, 115)))
    code = round_trip(rows).code
    worse = rows.clone()
    worse.view(torch.int16)[1, :3] = from_bits([1 << 7, 2 << 7, 3 << 7]).view(torch.int16)
    assert C.escape_counts(worse, code).tolist() == [0, 3]
    with pytest.raises(ValueError, match="row 1 has 3 escapes"):
        C.encode_rows(worse, code)
    with pytest.raises(ValueError, match="do not match"):
        C.encode_rows(rows.float(), code)


def test_only_bf16_is_coded() -> None:
    assert C.refusal(torch.bfloat16) is None
    assert "11 sign+mantissa bits" in C.refusal(torch.float16)
    for dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8):
        assert "8 bits or less" in C.refusal(dtype)
    assert "only bfloat16" in C.refusal(torch.float32)
    with pytest.raises(ValueError, match="float16"):
        C.plan_code(torch.ones(2, 64, dtype=torch.float16), chunk=1)


def test_decode_on_a_slice_of_rows_and_chunked_planning_agree() -> None:
    rows = (torch.randn(9, 3000, generator=torch.Generator().manual_seed(9)) * 0.02).to(torch.bfloat16)
    codes = {C.plan_code(rows, chunk=c).code for c in (1, 4, 9)}
    assert len(codes) == 1  # the table and capacity do not depend on the chunk
    code = codes.pop()
    packed = C.encode_rows(rows, code)
    assert torch.equal(bits_of(C.decode_rows(packed[5:8], code)), bits_of(rows[5:8]))


def test_an_accelerator_codes_a_bounded_number_of_rows_at_a_time() -> None:
    """Rows coded at a time: K on a CPU, on a GPU no more than fit the scratch bound (at least one), so a large
    expert codes without holding K of them in int32 there (the code does not depend on the chunk: above)."""
    assert C.coding_chunk(32, 10**7, "cpu") == 32
    assert C.coding_chunk(32, 10**7, torch.device("cuda", 0)) == C._SCRATCH_WEIGHTS // 10**7
    assert C.coding_chunk(32, 10**9, "cuda") == 1 and C.coding_chunk(4, 100, "cuda") == 4
