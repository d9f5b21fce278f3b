"""How far lossless compression could shrink paged expert rows: per expert tensor (one layer's
``gate_up_proj`` or ``down_proj``, all E rows), for bf16 and fp16.

This module owns the bit-level measurement and its report (a table on stdout, JSON):

- **entropy bound**: ``16 / (sign+mantissa bits + H(exponent))``, H over the tensor's exponent
  field; sign and mantissa are kept verbatim (they are near uniform), so this bounds any code that
  compresses exponents alone.
- **fixed-width code**: per tensor a table of its 15 most frequent exponents (code 15 is kept as
  an escape, so the table has 16 entries), each weight's exponent as a 4-bit code, sign and
  mantissa kept: bf16 12 bits a weight (0.75 of the bytes), as a uint8 sign+mantissa plane and a
  nibble plane. A row (one expert of one tensor) holding any exponent outside the table (an
  *escape*) is stored raw, with a flag: ``fallback`` counts those rows. ``fallback16`` counts
  them for a table of 16 (no escape code). Costs counted: 16 table bytes per tensor, one flag byte
  per row.
- **exception list** (for comparison, not the fixed-width code): every row coded, each escape
  stored beside it as (int32 index, raw 16 bits): 6 bytes an escape, 4 bytes a row for its count.
- fp16 has 11 sign+mantissa bits: its fixed-width code is 15 bits a weight, which no byte-plane
  layout holds (a uint8 plane plus 3 bits plus a nibble is 16 bits): ``bytes_ratio`` is what a
  byte-aligned layout gets (1.0), ``fixed`` the 15-bit packing's ratio.
- ``p_row_fallback@Q3`` projects the measured per-weight escape rate to one row of Qwen3-30B-A3B's
  ``down_proj`` (2048 x 768 weights), as if escapes were independent: ``1 - (1 - p)^n``.

Weights: trained checkpoints (``--checkpoint``, default ``tests/data/tiny_moe``, the byte-level
Qwen3-MoE of ``bench.models.train_moe``; ``--preset mid`` trains one with 32x larger rows), and
random weights drawn as transformers initialises Qwen3-MoE experts (normal, std 0.02, fp32, then
cast) in each checkpoint's shapes and in Qwen3-30B-A3B's (``--q3-experts`` rows of each). fp16
rows of a bf16 checkpoint are its weights cast to fp16 (exact above 2^-14; below, fp16's
subnormals round them).

    python -m bench.analysis.compressibility --json /tmp/compressibility.json
    python -m bench.analysis.compressibility --checkpoint tests/data/tiny_moe --checkpoint /tmp/mid_moe
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench import common

TABLE = 15  # exponents a table codes; code 15 stays free as the escape of the 16-entry table
CODE_BITS = 4
Q3_SHAPES = {"gate_up_proj": (2 * 768, 2048), "down_proj": (2048, 768)}  # Qwen3-30B-A3B, per expert
Q3_ROW = 2048 * 768  # the smaller Qwen3-30B-A3B row: the projection's best case


@dataclass(frozen=True)
class Format:
    """A 16-bit float's fields: the exponent's width and position; the rest is sign + mantissa."""

    name: str
    dtype: torch.dtype
    exp_bits: int
    exp_shift: int

    @property
    def rest_bits(self) -> int:
        return 16 - self.exp_bits


FORMATS = (Format("bf16", torch.bfloat16, 8, 7), Format("fp16", torch.float16, 5, 10))


@dataclass(frozen=True)
class TensorReport:
    """One tensor's figures (``[E, ...]`` rows of one 16-bit format)."""

    source: str
    tensor: str
    dtype: str
    experts: int
    row_weights: int
    distinct: int  # distinct exponents in the tensor
    row_distinct_max: int  # the most distinct exponents any one row holds
    entropy_bits: float  # H(exponent), bits a weight
    escapes: int  # weights whose exponent is not in the 15-entry table
    escapes_below: int  # of those, the ones below the table's smallest exponent (the tail near zero)
    fallback: int  # rows stored raw (an escape) with the 15-entry table
    fallback16: int  # the same with 16 entries (no escape code)
    raw_bytes: int
    entropy_bytes: float
    fixed_bytes: int
    exception_bytes: int
    byte_plane_bytes: int  # a byte-aligned layout of the fixed-width code

    @property
    def escape_rate(self) -> float:
        return self.escapes / (self.experts * self.row_weights)


def exponents(rows: torch.Tensor, fmt: Format) -> torch.Tensor:
    """The exponent field of every weight of ``rows`` (a ``fmt`` tensor), as int64 ``[E, n]``."""
    bits = rows.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    return ((bits >> fmt.exp_shift) & ((1 << fmt.exp_bits) - 1)).reshape(rows.shape[0], -1)


def table_of(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent exponents (ties: the larger exponent first; only ones present)."""
    order = sorted(range(counts.numel()), key=lambda e: (-int(counts[e]), -e))
    return torch.tensor([e for e in order[:size] if counts[e] > 0], dtype=torch.int64)


def measure(source: str, tensor: str, rows: torch.Tensor, fmt: Format) -> TensorReport:
    """``rows`` (``[E, ...]``, any float dtype) cast to ``fmt`` and measured."""
    rows = rows.to(fmt.dtype)
    exp = exponents(rows, fmt)
    e, n = exp.shape
    counts = torch.bincount(exp.flatten(), minlength=1 << fmt.exp_bits)
    p = counts[counts > 0].double() / exp.numel()
    entropy = float(-(p * p.log2()).sum())
    table = table_of(counts, TABLE)
    escaped = ~torch.isin(exp, table)
    row_escapes = escaped.sum(1)
    fallback = int((row_escapes > 0).sum())
    fallback16 = int((~torch.isin(exp, table_of(counts, TABLE + 1))).any(1).sum())
    row_distinct = max(int(torch.unique(r).numel()) for r in exp)
    raw_row = 2 * n
    coded_row = math.ceil(n * (fmt.rest_bits + CODE_BITS) / 8)
    byte_row = n * (math.ceil(fmt.rest_bits / 8) + 0.5)  # sign+mantissa in whole bytes, then the nibble
    header = 16 + e  # the table, one flag byte a row
    return TensorReport(
        source=source, tensor=tensor, dtype=fmt.name, experts=e, row_weights=n, distinct=int((counts > 0).sum()),
        row_distinct_max=row_distinct, entropy_bits=entropy, escapes=int(escaped.sum()),
        escapes_below=int((escaped & (exp < table.min())).sum()), fallback=fallback,
        fallback16=fallback16, raw_bytes=e * raw_row, entropy_bytes=e * n * (fmt.rest_bits + entropy) / 8,
        fixed_bytes=header + (e - fallback) * coded_row + fallback * raw_row,
        exception_bytes=header + e * (coded_row + 4) + 6 * int(row_escapes.sum()),
        byte_plane_bytes=header + int((e - fallback) * min(byte_row, raw_row)) + fallback * raw_row,
    )


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every stacked expert tensor of an HF checkpoint, as stored (``model.layers.L.mlp.experts.P``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    return {name: p.detach() for name, p in model.named_parameters()
            if ".experts." in name and p.dim() == 3}


def random_like(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Fresh weights of the same shapes, drawn as transformers initialises Qwen3-MoE experts."""
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.empty(t.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen) for n, t in tensors.items()}


def q3_random(experts: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {p: torch.empty((experts, *shape)).normal_(0.0, 0.02, generator=gen) for p, shape in Q3_SHAPES.items()}


@dataclass(frozen=True)
class Summary:
    """One source in one format, every tensor together (ratios of summed bytes)."""

    source: str
    dtype: str
    tensors: int
    row_weights: str
    entropy_bits: float
    entropy_ratio: float
    fixed_ratio: float
    byte_plane_ratio: float
    exception_ratio: float
    fallback: str
    fallback16: str
    escape_rate: float
    escapes_below: float  # the share of escapes below the table
    p_row_fallback_q3: float


def summarise(reports: list[TensorReport]) -> Summary:
    r0, raw = reports[0], sum(r.raw_bytes for r in reports)
    weights = sum(r.experts * r.row_weights for r in reports)
    rate = sum(r.escapes for r in reports) / weights
    sizes = sorted({r.row_weights for r in reports})
    rows = sum(r.experts for r in reports)
    return Summary(
        source=r0.source, dtype=r0.dtype, tensors=len(reports),
        row_weights="/".join(str(s) for s in sizes),
        entropy_bits=sum(r.entropy_bits * r.experts * r.row_weights for r in reports) / weights,
        entropy_ratio=raw / sum(r.entropy_bytes for r in reports),
        fixed_ratio=raw / sum(r.fixed_bytes for r in reports),
        byte_plane_ratio=raw / sum(r.byte_plane_bytes for r in reports),
        exception_ratio=raw / sum(r.exception_bytes for r in reports),
        fallback=f"{sum(r.fallback for r in reports)}/{rows}",
        fallback16=f"{sum(r.fallback16 for r in reports)}/{rows}",
        escape_rate=rate,
        escapes_below=sum(r.escapes_below for r in reports) / max(1, sum(r.escapes for r in reports)),
        p_row_fallback_q3=1.0 - (1.0 - rate) ** Q3_ROW,
    )


def sources(checkpoints: list[str], q3_experts: int, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for i, path in enumerate(checkpoints):
        label = Path(path).name
        trained = checkpoint_tensors(path)
        out[f"trained {label}"] = trained
        out[f"random {label} shapes"] = random_like(trained, seed + i)
    if q3_experts:
        out[f"random Qwen3-30B-A3B shapes ({q3_experts} experts)"] = q3_random(q3_experts, seed + 100)
    return out


def run(checkpoints: list[str], q3_experts: int = 4, seed: int = 0) -> dict:
    per_tensor: list[TensorReport] = []
    summaries: list[Summary] = []
    for source, tensors in sources(checkpoints, q3_experts, seed).items():
        for fmt in FORMATS:
            reports = [measure(source, name, t, fmt) for name, t in tensors.items()]
            per_tensor += reports
            summaries.append(summarise(reports))
    return dict(versions=common.versions(), table_size=TABLE, code_bits=CODE_BITS,
                summary=[asdict(s) for s in summaries],
                tensors=[dict(asdict(r), escape_rate=r.escape_rate) for r in per_tensor])


def cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.2e}" if 0 < abs(v) < 1e-2 else f"{v:.3f}"
    return str(v)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", action="append", help="an HF MoE checkpoint (repeatable; default tiny_moe)")
    ap.add_argument("--q3-experts", type=int, default=4, help="random rows at Qwen3-30B-A3B shapes (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the summary and every tensor's figures here")
    args = ap.parse_args(argv)
    result = run(args.checkpoint or ["tests/data/tiny_moe"], args.q3_experts, args.seed)
    print(common.versions())
    print(common.table(result["summary"], cell=cell))
    common.write_json(args.json, result)


if __name__ == "__main__":
    main()
