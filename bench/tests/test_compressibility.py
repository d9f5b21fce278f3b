"""``bench.analysis.compressibility`` counts what it claims: entropy of the exponent field, the
15-entry table's boundary (15 distinct exponents coded, a 16th forces the row raw), and the bytes
of each layout."""

from __future__ import annotations

import pytest
import torch

from bench.analysis import compressibility as cz

BF16, FP16 = cz.FORMATS


def with_exponents(exps: list[list[int]], fmt: cz.Format = BF16) -> torch.Tensor:
    """Rows of ``fmt`` weights whose exponent fields are ``exps`` (sign and mantissa varied)."""
    bits = []
    for r, row in enumerate(exps):
        bits.append([((i + r) % 2) << 15 | e << fmt.exp_shift | (i * 37) % (1 << fmt.exp_shift)
                     for i, e in enumerate(row)])
    raw = torch.tensor(bits, dtype=torch.int32).to(torch.int16)  # wraps the sign bit into place
    return raw.view(fmt.dtype)


def test_exponents_read_the_field() -> None:
    rows = torch.tensor([[1.0, -2.0, 0.5, 0.0]], dtype=torch.bfloat16)
    assert cz.exponents(rows, BF16).tolist() == [[127, 128, 126, 0]]
    assert cz.exponents(rows.to(torch.float16), FP16).tolist() == [[15, 16, 14, 0]]


def test_entropy_of_two_equal_exponents_is_one_bit() -> None:
    r = cz.measure("t", "x", with_exponents([[100, 101] * 8]), BF16)
    assert r.entropy_bits == pytest.approx(1.0)
    assert r.raw_bytes / r.entropy_bytes == pytest.approx(16 / 9)


def test_fifteen_exponents_fit_a_sixteenth_falls_back() -> None:
    fits = [list(range(100, 115)) * 4]  # 60 weights, 15 exponents
    over = [list(range(100, 115)) * 4]
    over[0][7] = 50  # one odd weight
    ok = cz.measure("t", "x", with_exponents(fits + fits), BF16)
    assert (ok.escapes, ok.fallback, ok.fallback16) == (0, 0, 0)
    assert ok.fixed_bytes == 16 + 2 + 2 * 60 * 12 // 8
    bad = cz.measure("t", "x", with_exponents(fits + over), BF16)
    assert (bad.escapes, bad.escapes_below, bad.fallback, bad.fallback16) == (1, 1, 1, 0)  # 16 entries hold it
    assert bad.fixed_bytes == 16 + 2 + 60 * 12 // 8 + 60 * 2


def test_rows_are_measured_against_one_table_per_tensor() -> None:
    # Each row alone has one exponent, but together 16: the rarest one escapes.
    rows = [[100 + r] * (10 + r) + [100] * (25 - r) for r in range(16)]
    r = cz.measure("t", "x", with_exponents(rows), BF16)
    assert r.distinct == 16 and r.row_distinct_max == 2
    assert r.fallback == 1


def test_fp16_byte_planes_gain_nothing() -> None:
    r = cz.measure("t", "x", with_exponents([list(range(16)) * 4], FP16).to(torch.float32), FP16)
    assert r.byte_plane_bytes == r.raw_bytes + 17  # 2 bytes a weight either way, plus the header
    assert r.raw_bytes / r.fixed_bytes < 16 / 15
