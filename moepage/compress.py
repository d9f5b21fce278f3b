"""Lossless compression of bf16 expert rows in the host store: a 4-bit exponent code with an
exception list.

This module owns the code: choosing it for one paged tensor (``plan_code``: one name, all E
rows), the row layout (``RowLayout``), the encoder (``encode_rows``) and the reference decoder
(``decode_rows``; ``kernels.unpack`` is the Triton one): vectorised torch on any device, so rows
are coded on the GPU they load for where there is one (a CPU codes them several times slower).
It knows no store, slot or framework.

Why this code (``bench.analysis.compressibility``): a bf16 exponent carries ~2.6 bits of entropy,
sign and mantissa are near uniform. Per tensor a 16-entry table holds its 15 most frequent
exponents (ties: the larger first); code 15 is the escape. Every row has one fixed width, so a
slot's decode is parallel and capturable:

    [0, n)                       uint8 per weight: sign << 7 | mantissa (7 bits)
    [codes, codes + ceil(n/2))   4-bit codes: weight 2i in the low nibble of byte i, 2i+1 high
    [count, count + 4)           int32: the row's escapes
    [indices, indices + 4C)      int32: each escape's weight index, ascending (unused: 0)
    [values, values + 2C)        uint16: each escaped weight's raw bits (unused: 0)

Sections start 16-byte aligned (gaps and padding are zero); the capacity C is the most escapes of
any of the tensor's rows, rounded up to 8. About 1.5-2e-4 of bf16 weights escape (trained or
random), so a row costs ~12.05 bits a weight: 1.33x.

A tensor stays raw (``Coding.code`` None, ``Coding.why`` says why) when a row escapes more than
1/64 of its weights, or when its coded row is not smaller than the raw one (tiny rows): in a
fixed-width table one raw row makes every row raw-sized, so such a tensor gains nothing coded.
Only bf16 is coded (``refusal`` says why not the others).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["Coding", "RowLayout", "TensorCode", "code_rows", "coding_chunk", "decode_rows", "encode_rows",
           "escape_counts", "plan_code", "refusal"]

ESCAPE = 15  # the code of a weight whose exponent is not in the table
CAP = 64  # a row may escape at most 1/CAP of its weights
_STEP = 8  # capacities are multiples of this
_ALIGN = 16  # section alignment: vector accesses in the decode kernel
_SCRATCH_WEIGHTS = 1 << 26  # weights coded at once on an accelerator (about 0.5 GiB of scratch)


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def refusal(dtype: torch.dtype) -> str | None:
    """Why rows of ``dtype`` are not coded (None for bf16, the one coded dtype)."""
    if dtype == torch.bfloat16:
        return None
    if dtype == torch.float16:
        return ("float16 keeps 11 sign+mantissa bits: with a 4-bit exponent code that is 15 bits a weight, "
                "which no byte-aligned row layout holds in less than 16")
    if dtype.itemsize == 1 or dtype.is_floating_point and dtype.itemsize < 2:
        return f"{dtype} rows are 8 bits or less a weight already: no exponent field worth coding"
    return "only bfloat16 is coded (its exponent byte is where the redundancy is)"


@dataclass(frozen=True, kw_only=True)
class RowLayout:
    """Byte offsets of one coded row of ``weights`` weights and ``capacity`` escapes (module doc)."""

    weights: int
    capacity: int

    @property
    def codes(self) -> int:
        return _up(self.weights, _ALIGN)

    @property
    def count(self) -> int:
        return _up(self.codes + (self.weights + 1) // 2, _ALIGN)

    @property
    def indices(self) -> int:
        return self.count + _ALIGN

    @property
    def values(self) -> int:
        return self.indices + 4 * self.capacity

    @property
    def nbytes(self) -> int:
        return _up(self.values + 2 * self.capacity, _ALIGN)


@dataclass(frozen=True, kw_only=True)
class TensorCode:
    """How one tensor's rows are coded: code c < ``len(table)`` stands for exponent ``table[c]``
    (at most 15 entries); 15 is the escape."""

    shape: tuple[int, ...]
    table: tuple[int, ...]
    layout: RowLayout

    @property
    def weights(self) -> int:
        return self.layout.weights

    @property
    def nbytes(self) -> int:
        """Bytes of one coded row."""
        return self.layout.nbytes

    @property
    def raw_nbytes(self) -> int:
        return 2 * self.weights

    @property
    def exponents(self) -> tuple[int, ...]:
        """The 16 exponents a decoder reads by code (unused codes and the escape: 0)."""
        return self.table + (0,) * (16 - len(self.table))

    def record(self) -> dict:
        """As JSON (a layout of coded rows kept on disk names its code): ``from_record`` reads it back."""
        return {"shape": list(self.shape), "table": list(self.table), "capacity": self.layout.capacity}

    @classmethod
    def from_record(cls, data: dict) -> TensorCode:
        shape = tuple(int(d) for d in data["shape"])
        return cls(shape=shape, table=tuple(int(x) for x in data["table"]),
                   layout=RowLayout(weights=math.prod(shape), capacity=int(data["capacity"])))

    def lut(self) -> torch.Tensor:
        """int32 ``[256]``: each exponent's code (15 for the ones the table lacks)."""
        lut = torch.full((256,), ESCAPE, dtype=torch.int32)
        lut[torch.tensor(self.table, dtype=torch.long)] = torch.arange(len(self.table), dtype=torch.int32)
        return lut


@dataclass(frozen=True, kw_only=True)
class Coding:
    """What ``plan_code`` chose for one tensor: ``code``, or None (kept raw) and ``why``."""

    code: TensorCode | None
    max_escapes: int
    why: str = ""


def _words(rows: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """int16 ``[m, n]`` on ``device``: each weight's 16 bits (a view where ``rows`` already is one)."""
    flat = rows.detach().to(device).contiguous().reshape(rows.shape[0], math.prod(rows.shape[1:]))
    return flat.view(torch.int16)


def coding_chunk(rows: int, weights: int, device: torch.device | str) -> int:
    """Rows coded at a time on ``device``: ``rows`` (the K an adapter pages) on a CPU; on an accelerator no more
    than fit a bounded scratch (a row's weights are held in several int32 and uint8 forms while it is coded)."""
    if torch.device(device).type == "cpu":
        return max(1, rows)
    return max(1, min(rows, _SCRATCH_WEIGHTS // max(1, weights)))


def _exponent(words: torch.Tensor) -> torch.Tensor:
    # int32: the index dtype index_select and bincount take without a further copy.
    return ((words >> 7) & 0xFF).to(torch.int32)


def _to_int16(bits: torch.Tensor) -> torch.Tensor:
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16)


def _table_of(hist: torch.Tensor) -> tuple[int, ...]:
    """The (at most) 15 most frequent exponents present, ties: the larger first."""
    order = torch.argsort(hist * 256 + torch.arange(256), descending=True)[:ESCAPE]
    return tuple(int(e) for e in order if hist[e] > 0)


def plan_code(rows: torch.Tensor, *, chunk: int, device: torch.device | str = "cpu") -> Coding:
    """The code of one tensor's rows ``[E, *shape]`` (bf16, any device), read once on ``device``,
    ``coding_chunk`` rows at a time (per-row exponent histograms give the table and every row's
    escapes)."""
    if rows.dtype != torch.bfloat16:
        raise ValueError(f"only bfloat16 rows are coded, got {rows.dtype}: {refusal(rows.dtype)}")
    e, shape = rows.shape[0], tuple(rows.shape[1:])
    n = math.prod(shape)
    if n == 0 or e == 0:
        return Coding(code=None, max_escapes=0, why="empty rows")
    chunk = coding_chunk(chunk, n, device)
    per_row = []
    for i in range(0, e, chunk):
        exp = _exponent(_words(rows[i : i + chunk], device))
        m = exp.shape[0]
        exp += 256 * torch.arange(m, dtype=torch.int32, device=exp.device)[:, None]  # row r: bins [256r, 256r + 256)
        per_row.append(torch.bincount(exp.view(-1), minlength=256 * m).view(m, 256))
    hist = torch.cat(per_row).cpu()
    table = _table_of(hist.sum(0))
    outside = torch.ones(256, dtype=torch.bool)
    outside[list(table)] = False
    escapes = hist[:, outside].sum(1)
    worst, at = int(escapes.max()), int(escapes.argmax())
    if worst > n // CAP:
        return Coding(code=None, max_escapes=worst,
                      why=f"row {at} escapes {worst} of its {n} weights, over the cap of 1/{CAP} ({n // CAP})")
    code = TensorCode(shape=shape, table=table, layout=RowLayout(weights=n, capacity=_up(worst, _STEP)))
    if code.nbytes >= code.raw_nbytes:
        return Coding(code=None, max_escapes=worst,
                      why=f"a coded row takes {code.nbytes} bytes, not fewer than the raw {code.raw_nbytes}")
    return Coding(code=code, max_escapes=worst)


def _codes(words: torch.Tensor, code: TensorCode) -> torch.Tensor:
    """uint8 ``[m, n]``: each weight's code (on ``words``' device)."""
    lut = code.lut().to(device=words.device, dtype=torch.uint8)
    return lut.index_select(0, _exponent(words).view(-1)).view(words.shape)


def escape_counts(rows: torch.Tensor, code: TensorCode, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 ``[m]`` on ``device``: each row's weights whose exponent ``code``'s table lacks."""
    return (_codes(_words(rows, device), code) == ESCAPE).sum(1)


def encode_rows(rows: torch.Tensor, code: TensorCode, device: torch.device | str = "cpu") -> torch.Tensor:
    """uint8 ``[m, code.nbytes]`` on ``device`` (where it is coded): ``rows`` ``[m, *code.shape]``
    (bf16) coded. A row with more escapes than the code's capacity is a ``ValueError`` (nothing is
    returned)."""
    if rows.dtype != torch.bfloat16 or tuple(rows.shape[1:]) != code.shape:
        raise ValueError(f"rows {rows.dtype} {tuple(rows.shape)} do not match the code's bf16 rows {code.shape}")
    lay, n, m = code.layout, code.weights, rows.shape[0]
    words = _words(rows, device)
    codes = _codes(words, code)
    escaped = codes == ESCAPE
    counts = escaped.sum(1)
    if m and int(counts.max()) > lay.capacity:
        r = int(counts.argmax())
        raise ValueError(f"row {r} has {int(counts[r])} escapes; this tensor's code holds at most {lay.capacity}")
    out = torch.zeros(m, lay.nbytes, dtype=torch.uint8, device=words.device)
    out[:, :n] = (((words >> 8) & 0x80) | (words & 0x7F)).to(torch.uint8)
    if n % 2:
        codes = torch.cat([codes, codes.new_zeros(m, 1)], 1)
    out[:, lay.codes : lay.codes + (n + 1) // 2] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    out[:, lay.count : lay.count + 4] = counts.to(torch.int32).reshape(m, 1).view(torch.uint8)
    if lay.capacity:
        row, col = escaped.nonzero(as_tuple=True)  # row-major: ascending index within a row
        rank = torch.arange(row.numel(), device=words.device) - (torch.cumsum(counts, 0) - counts)[row]
        idx = torch.zeros(m, lay.capacity, dtype=torch.int32, device=words.device)
        val = torch.zeros(m, lay.capacity, dtype=torch.int16, device=words.device)
        idx[row, rank] = col.to(torch.int32)
        val[row, rank] = words[row, col]
        out[:, lay.indices : lay.values] = idx.view(torch.uint8)
        out[:, lay.values : lay.values + 2 * lay.capacity] = val.view(torch.uint8)
    return out


def misfit(rows: torch.Tensor, code: TensorCode, *, chunk: int, device: torch.device | str) -> tuple[int, int] | None:
    """The first row of ``rows`` with more escapes than ``code`` has room for, and its count; None where all fit."""
    step = coding_chunk(chunk, code.weights, device)
    for i in range(0, rows.shape[0], step):
        counts = escape_counts(rows[i : i + step].to(torch.bfloat16), code, device)
        if int(counts.max()) > code.layout.capacity:
            return i + int(counts.argmax()), int(counts.max())
    return None


def code_rows(rows: torch.Tensor, code: TensorCode, *, chunk: int, device: torch.device | str
              ) -> Iterator[tuple[int, torch.Tensor]]:
    """``(i, coded)`` for all E ``rows`` (any dtype bf16 holds as ``copy_`` would; each fits ``code``: ``misfit``),
    ``coded`` being rows ``i..`` coded on ``device``, ``coding_chunk`` at a time."""
    step = coding_chunk(chunk, code.weights, device)
    for i in range(0, rows.shape[0], step):
        yield i, encode_rows(rows[i : i + step].to(torch.bfloat16), code, device)
    if torch.device(device).type == "cuda":  # the coding scratch back: an engine sizes its KV cache from free memory
        torch.cuda.empty_cache()


@lru_cache(maxsize=256)
def _exponents(code: TensorCode, device: torch.device) -> torch.Tensor:
    # Cached: a decode on a device copies no table there (a page-in under capture may not).
    return torch.tensor(code.exponents, dtype=torch.int32, device=device)


def decode_rows(packed: torch.Tensor, code: TensorCode) -> torch.Tensor:
    """bf16 ``[m, *code.shape]`` on ``packed``'s device: coded rows ``[m, code.nbytes]`` (uint8)
    decoded, fixed-shape ops (no host sync: escapes beyond each row's count go to a dropped column)."""
    lay, n, m = code.layout, code.weights, packed.shape[0]
    sm = packed[:, :n].to(torch.int32)
    pairs = packed[:, lay.codes : lay.codes + (n + 1) // 2].to(torch.int32)
    codes = torch.stack([pairs & 15, pairs >> 4], 2).reshape(m, -1)[:, :n]
    bits = ((sm & 0x80) << 8) | (_exponents(code, packed.device)[codes] << 7) | (sm & 0x7F)
    if lay.capacity:
        count = packed[:, lay.count : lay.count + 4].contiguous().view(torch.int32)
        idx = packed[:, lay.indices : lay.values].contiguous().view(torch.int32).long()
        val = packed[:, lay.values : lay.values + 2 * lay.capacity].contiguous().view(torch.int16)
        valid = torch.arange(lay.capacity, device=packed.device) < count
        bits = torch.cat([bits, bits.new_zeros(m, 1)], 1)
        bits.scatter_(1, torch.where(valid, idx, n), torch.where(valid, val.to(torch.int32) & 0xFFFF, 0))
        bits = bits[:, :n]
    return _to_int16(bits).view(torch.bfloat16).reshape(m, *code.shape)
