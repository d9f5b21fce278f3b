"""Derive the calibration that ``moepage synth`` ships (``moepage/planning/data``, a real 48-layer,
128-expert, top-8 model's decode heat: Qwen3-30B-A3B's) from the shared mbolt aggregates.

The aggregates JSON (1.8 MB: per layer ``heat``, co-activation ``pairs``, ``clusters``,
``chain_order``) is reduced to what ``moepage.planning.synthetic.load_popularity`` reads: ``k``,
``n_decode_tokens`` and per layer ``{layer, heat}`` (the per-expert selection counts), unchanged.
The result is itself an aggregates JSON, so ``--calibration`` reads either file the same way.

    python -m bench.data.make_calibration [AGGREGATES.json] [OUT.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.data.traces import CALIBRATION_SOURCE, SHARED

SOURCE = SHARED / CALIBRATION_SOURCE
OUT = Path(__file__).resolve().parents[2] / "moepage" / "planning" / "data" / "heat_48x128_top8.json"


def reduce_aggregates(aggregates: dict) -> dict:
    """The calibration: per-layer popularity counts and the totals they are relative to."""
    return {
        "source": "github doramirdor/mbolt results/colibri-119/coactivation_qwen3-30b-a3b.json, "
        "reduced by moepage bench/make_calibration.py (heat only: pairs, clusters and chain_order dropped)",
        "model": aggregates["model"],
        "quant": aggregates["quant"],
        "k": aggregates["k"],
        "n_decode_tokens": aggregates["n_decode_tokens"],
        "layers": [{"layer": layer["layer"], "heat": layer["heat"]} for layer in aggregates["layers"]],
    }


def write(calibration: dict, out: Path) -> None:
    """One layer per line: small, and readable in a diff."""
    head = {k: v for k, v in calibration.items() if k != "layers"}
    lines = [json.dumps(head)[:-1] + ', "layers": [']
    rows = [json.dumps(layer, separators=(",", ":")) for layer in calibration["layers"]]
    lines += [row + ("," if i < len(rows) - 1 else "") for i, row in enumerate(rows)]
    lines.append("]}")
    out.write_text("\n".join(lines) + "\n")


def main() -> None:
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    write(reduce_aggregates(json.loads(source.read_text())), out)
    print(f"wrote {out} ({out.stat().st_size} bytes) from {source}")


if __name__ == "__main__":
    main()
