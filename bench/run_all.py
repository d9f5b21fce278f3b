"""The whole benchmark suite in one command: CUDA backend, Hugging Face decode, trace replay,
SGLang's kernels side by side, the whole-model captured decode.

    python -m bench.run_all --out DIR [--layers 8] [--skip-gpu] [--parts replay,cuda,...]

Runs each part in its own process: ``analysis.trace_replay`` (CPU), then ``kernels.cuda_bench``,
``kernels.decode_profile``, ``models.prefill_bench``, ``models.hf_bench`` (with the over-budget
load), ``kernels.sglang_kernels`` and ``models.model_decode`` (GPU). ``--parts`` picks some of them by name (all
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

from bench import common

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("replay", "cuda", "profile", "prefill", "hf", "sglang_kernels", "model_decode")
FAILED: list[str] = []


def run(module: str, args: list[str], log: Path, check: bool = True) -> str:
    """The stdout of ``python -m bench.<module>``; a failure stops the suite, or with
    ``check=False`` is noted and returned as the log's tail."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([sys.executable, "-m", f"bench.{module}", *args], capture_output=True, text=True, env=env,
                         cwd=ROOT)
    log.write_text(out.stdout + out.stderr)
    if out.returncode and check:
        raise SystemExit(f"{module} failed ({out.returncode}); see {log}")
    if out.returncode:
        FAILED.append(f"{module} ({out.returncode}; see {log})")
        return f"**FAILED** ({out.returncode}); the log ends:\n\n```\n{(out.stdout + out.stderr)[-3000:]}\n```"
    return out.stdout


def plot_bars(rows: list[dict], series: tuple[tuple[str, str], ...], ticks: list[str], ylabel: str, path: Path) -> None:
    """Grouped bars: one group per row, one bar per (key, label) of ``series``."""
    fig, (ax,) = common.figure()
    common.bars(ax, [(label, [r[key] for r in rows]) for key, label in series])
    ax.set_xticks(list(range(len(rows))), ticks)
    ax.set_ylabel(ylabel)
    ax.legend()
    common.save(fig, path)


def plot_decode(rows: list[dict], path: Path) -> None:
    paged = [r for r in rows if r["run"] == "moepage"]
    fig, (ax,) = common.figure()
    fracs = [float(r["k_over_e"].rstrip("%")) for r in paged]
    ax.plot(fracs, [r["tok_s"] for r in paged], "o-", label="moepage")
    ax.plot(fracs, [1e3 / float(r["bound_ms"]) for r in paged], "k--", label="bound")
    for r in rows:
        if r["run"].startswith("unpaged ("):
            ax.axhline(r["tok_s"], color="g", label="unpaged (all on GPU)")
        if r["run"].startswith("accelerate"):
            ax.axhline(r["tok_s"], color="r", label="accelerate device_map")
    ax.set(xlabel="K / E (%)", ylabel="decode tokens/s", yscale="log")
    ax.legend()
    common.save(fig, path)


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
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    md = [f"## {datetime.date.today()} — python -m bench.run_all\n"]

    def section(title: str, text: str) -> None:
        # Written after every part, so a run cut short still leaves the parts it finished.
        md.append(f"### {title}\n\n{text}")
        (out / "RESULTS-run.md").write_text("\n\n".join(md) + "\n")

    if "replay" in parts:
        replay = run("analysis.trace_replay", ["--md", str(out / "policies.md"), "--png", str(out / "policies.png")],
                     out / "trace_replay.log")
        section("Eviction policies (trace replay)", replay)  # the table, the verdict, the time
    if "cuda" in parts:
        cuda = run("kernels.cuda_bench", ["--json", str(out / "cuda.json")], out / "cuda.log")
        section("CUDA backend", cuda[cuda.index("###"):])
        gather = json.loads((out / "cuda.json").read_text())["a_gather"]
        plot_bars(gather, (("gather_gbs", "device gather"), ("per_row_gbs", "per-row memcpy"),
                           ("memcpy_gbs", "one memcpy")),
                  [f"{r['row_mb']} MB rows" for r in gather], "GB/s", out / "gather.png")
    if "profile" in parts:
        section("Paged decode step, stage by stage", run("kernels.decode_profile", [], out / "decode_profile.log"))
    if "prefill" in parts:
        prefill = run("models.prefill_bench", ["--json", str(out / "prefill.json")], out / "prefill.log")
        section("Multi-wave prefill overlap", prefill)
        rows = json.loads((out / "prefill.json").read_text())
        plot_bars(rows, (("serial_ms", "serialized waves"), ("overlapped_ms", "overlapped waves"),
                         ("bound_ms", "bound max(compute, page-in)")),
                  [f"K/E {r['k_over_e']:.2f}\n{r['tokens']} tokens" for r in rows], "ms per layer step",
                  out / "prefill.png")
    if "hf" in parts:
        hf = run("models.hf_bench", ["--layers", str(args.layers), "--budget-load", "/tmp/moepage-ckpt",
                  "--json", str(out / "hf.json")], out / "hf.log")
        section("Hugging Face decode", hf)
        plot_decode(json.loads((out / "hf.json").read_text()), out / "decode.png")
    if "sglang_kernels" in parts:
        text = run("kernels.sglang_kernels", ["--json", str(out / "sglang_kernels.json")], out / "sglang_kernels.log",
                   check=False)
        section("SGLang's paged-experts kernels side by side", text)
    if "model_decode" in parts:
        text = run("models.model_decode", ["--out", str(out / "model_decode")], out / "model_decode.log", check=False)
        table_md = out / "model_decode" / "model_decode.md"  # written even when a row failed
        failed = text if text.startswith("**FAILED**") else ""
        section("Whole-model captured decode", table_md.read_text() + "\n" + failed if table_md.exists() else text)
    print((out / "RESULTS-run.md").read_text())
    if FAILED:
        raise SystemExit(f"failed parts: {'; '.join(FAILED)}")

if __name__ == "__main__":
    main()
