"""The whole benchmark suite in one command: CUDA backend, Hugging Face decode, trace replay.

    python bench/run_all.py --out DIR [--layers 8] [--skip-gpu]

Runs ``cuda_bench.py``, ``decode_profile.py``, ``hf_bench.py`` (with the over-budget load) and
``prefill_bench.py`` (GPU) and ``trace_replay.py`` (CPU), each in its own process. It writes to
``DIR``:
- their JSON and logs;
- ``RESULTS-run.md``: the tables, ready to paste into bench/RESULTS.md under a dated heading;
- ``gather.png``, ``decode.png``, ``prefill.png`` and ``policies.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(args: list[str], log: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env)
    log.write_text(out.stdout + out.stderr)
    if out.returncode:
        raise SystemExit(f"{args[0]} failed ({out.returncode}); see {log}")
    return out.stdout


def plot_bars(rows: list[dict], series: tuple[tuple[str, str], ...], ticks: list[str], ylabel: str, path: Path) -> None:
    """Grouped bars: one group per row, one bar per (key, label) of ``series``."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(series)
    for i, (key, label) in enumerate(series):
        offset = width * (i - (len(series) - 1) / 2)
        ax.bar([j + offset for j in range(len(rows))], [r[key] for r in rows], width=width, label=label)
    ax.set_xticks(list(range(len(rows))), ticks)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_decode(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    paged = [r for r in rows if r["run"] == "moepage"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    fracs = [float(r["k_over_e"].rstrip("%")) for r in paged]
    ax.plot(fracs, [r["tok_s"] for r in paged], "o-", label="moepage")
    ax.plot(fracs, [1e3 / float(r["bound_ms"]) for r in paged], "k--", label="bound")
    for r in rows:
        if r["run"].startswith("unpaged ("):
            ax.axhline(r["tok_s"], color="g", label="unpaged (all on GPU)")
        if r["run"].startswith("accelerate"):
            ax.axhline(r["tok_s"], color="r", label="accelerate device_map")
    ax.set_xlabel("K / E (%)")
    ax.set_ylabel("decode tokens/s")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--skip-gpu", action="store_true")
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    md = [f"## {datetime.date.today()} — bench/run_all.py\n"]

    def section(title: str, text: str) -> None:
        # Written after every part, so a run cut short still leaves the parts it finished.
        md.append(f"### {title}\n\n{text}")
        (out / "RESULTS-run.md").write_text("\n\n".join(md) + "\n")

    replay = run([str(HERE / "trace_replay.py"), "--md", str(out / "policies.md"), "--png", str(out / "policies.png")],
                 out / "trace_replay.log")
    section("Eviction policies (trace replay)", replay)  # the table, the verdict, the time
    if not args.skip_gpu:
        cuda = run([str(HERE / "cuda_bench.py"), "--json", str(out / "cuda.json")], out / "cuda.log")
        section("CUDA backend", cuda[cuda.index("###"):])
        gather = json.loads((out / "cuda.json").read_text())["a_gather"]
        plot_bars(gather, (("gather_gbs", "device gather"), ("per_row_gbs", "per-row memcpy"), ("memcpy_gbs", "one memcpy")),
                  [f"{r['row_mb']} MB rows" for r in gather], "GB/s", out / "gather.png")
        section("Paged decode step, stage by stage", run([str(HERE / "decode_profile.py")], out / "decode_profile.log"))
        prefill = run([str(HERE / "prefill_bench.py"), "--json", str(out / "prefill.json")], out / "prefill.log")
        section("Multi-wave prefill overlap", prefill)
        rows = json.loads((out / "prefill.json").read_text())
        plot_bars(rows, (("serial_ms", "serialized waves"), ("overlapped_ms", "overlapped waves"),
                         ("bound_ms", "bound max(compute, page-in)")),
                  [f"K/E {r['k_over_e']:.2f}\n{r['tokens']} tokens" for r in rows], "ms per layer step", out / "prefill.png")
        hf = run([str(HERE / "hf_bench.py"), "--layers", str(args.layers), "--budget-load", "/tmp/moepage-ckpt",
                  "--json", str(out / "hf.json")], out / "hf.log")
        section("Hugging Face decode", hf)
        plot_decode(json.loads((out / "hf.json").read_text()), out / "decode.png")
    print((out / "RESULTS-run.md").read_text())

if __name__ == "__main__":
    main()
