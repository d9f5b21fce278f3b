"""The whole benchmark suite in one command: CUDA backend, Hugging Face decode, trace replay,
SGLang's kernels side by side, the whole-model captured decode.

    python bench/run_all.py --out DIR [--layers 8] [--skip-gpu] [--parts replay,cuda,...]

Runs each part in its own process: ``trace_replay.py`` (CPU), then ``cuda_bench.py``,
``decode_profile.py``, ``prefill_bench.py``, ``hf_bench.py`` (with the over-budget load),
``sglang_kernels.py`` and ``model_decode.py`` (GPU). ``--parts`` picks some of them by name (all
by default; the whole suite takes longer than one 10-minute device call, so split it there). A
failing ``sglang_kernels`` or ``model_decode`` is recorded and the suite goes on (exit 1 at the
end); any other failing part stops it. It writes to ``DIR``:
- their JSON and logs;
- ``RESULTS-run.md``: the tables, ready to paste into bench/RESULTS.md under a dated heading;
- ``gather.png``, ``decode.png``, ``prefill.png``, ``policies.png`` and
  ``model_decode/model_decode.png``.
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
PARTS = ("replay", "cuda", "profile", "prefill", "hf", "sglang_kernels", "model_decode")
FAILED: list[str] = []


def run(args: list[str], log: Path, check: bool = True) -> str:
    """The part's stdout; a failure stops the suite, or with ``check=False`` is noted and returned
    as the log's tail."""
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env)
    log.write_text(out.stdout + out.stderr)
    if out.returncode and check:
        raise SystemExit(f"{args[0]} failed ({out.returncode}); see {log}")
    if out.returncode:
        FAILED.append(f"{Path(args[0]).name} ({out.returncode}; see {log})")
        return f"**FAILED** ({out.returncode}); the log ends:\n\n```\n{(out.stdout + out.stderr)[-3000:]}\n```"
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
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    args = ap.parse_args()
    parts = set(args.parts.split(",")) - (set(PARTS[1:]) if args.skip_gpu else set())
    if parts - set(PARTS):
        raise SystemExit(f"unknown parts {sorted(parts - set(PARTS))}; known: {', '.join(PARTS)}")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    md = [f"## {datetime.date.today()} — bench/run_all.py\n"]

    def section(title: str, text: str) -> None:
        # Written after every part, so a run cut short still leaves the parts it finished.
        md.append(f"### {title}\n\n{text}")
        (out / "RESULTS-run.md").write_text("\n\n".join(md) + "\n")

    if "replay" in parts:
        replay = run([str(HERE / "trace_replay.py"), "--md", str(out / "policies.md"), "--png", str(out / "policies.png")],
                     out / "trace_replay.log")
        section("Eviction policies (trace replay)", replay)  # the table, the verdict, the time
    if "cuda" in parts:
        cuda = run([str(HERE / "cuda_bench.py"), "--json", str(out / "cuda.json")], out / "cuda.log")
        section("CUDA backend", cuda[cuda.index("###"):])
        gather = json.loads((out / "cuda.json").read_text())["a_gather"]
        plot_bars(gather, (("gather_gbs", "device gather"), ("per_row_gbs", "per-row memcpy"), ("memcpy_gbs", "one memcpy")),
                  [f"{r['row_mb']} MB rows" for r in gather], "GB/s", out / "gather.png")
    if "profile" in parts:
        section("Paged decode step, stage by stage", run([str(HERE / "decode_profile.py")], out / "decode_profile.log"))
    if "prefill" in parts:
        prefill = run([str(HERE / "prefill_bench.py"), "--json", str(out / "prefill.json")], out / "prefill.log")
        section("Multi-wave prefill overlap", prefill)
        rows = json.loads((out / "prefill.json").read_text())
        plot_bars(rows, (("serial_ms", "serialized waves"), ("overlapped_ms", "overlapped waves"),
                         ("bound_ms", "bound max(compute, page-in)")),
                  [f"K/E {r['k_over_e']:.2f}\n{r['tokens']} tokens" for r in rows], "ms per layer step", out / "prefill.png")
    if "hf" in parts:
        hf = run([str(HERE / "hf_bench.py"), "--layers", str(args.layers), "--budget-load", "/tmp/moepage-ckpt",
                  "--json", str(out / "hf.json")], out / "hf.log")
        section("Hugging Face decode", hf)
        plot_decode(json.loads((out / "hf.json").read_text()), out / "decode.png")
    if "sglang_kernels" in parts:
        text = run([str(HERE / "sglang_kernels.py"), "--json", str(out / "sglang_kernels.json")], out / "sglang_kernels.log",
                   check=False)
        section("SGLang's paged-experts kernels side by side", text)
    if "model_decode" in parts:
        text = run([str(HERE / "model_decode.py"), "--out", str(out / "model_decode")], out / "model_decode.log", check=False)
        table_md = out / "model_decode" / "model_decode.md"  # written even when a row failed
        failed = text if text.startswith("**FAILED**") else ""
        section("Whole-model captured decode", table_md.read_text() + "\n" + failed if table_md.exists() else text)
    print((out / "RESULTS-run.md").read_text())
    if FAILED:
        raise SystemExit(f"failed parts: {'; '.join(FAILED)}")

if __name__ == "__main__":
    main()
