"""A paged decode layer at 100 % hits, captured, against the unpaged layer: this tree beside
another moepage tree (e.g. an older commit's), side by side in one run.

    python -m bench.kernels.hit_before_after --before DIR [--rounds 3] [--json OUT]
    python -m bench.kernels.hit_before_after --before DIR --ops   # CPU: the aten ops of one hit step, per tree

``DIR`` holds the other tree's ``moepage/`` and ``pyproject.toml``. Two packages named
``moepage`` cannot live in one process, so each measurement is a child process on one tree (its
entry points declared from its own pyproject, as ``bench/gpu_sglang_lease.sh`` does), the trees
alternating ``--rounds`` times; the table gives each tree's median over the rounds. Each child:
Qwen3-30B-A3B expert shapes (E = 128, top-8, H = 2048, I = 768, bf16, ``grouped_mm``), K = 64,
routing over the resident experts only, every output ``torch.equal`` to unpaged first, then 20
steps per CUDA graph replayed 20 times, paged and unpaged. ``--ops`` (no GPU needed) lists the aten ops one
captured-path step (device planner, ``capture_mode``) dispatches on the CPU in each tree, and where they differ:
each op beyond the unpaged layer's is a kernel launch a graph replays.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
TOKENS = (1, 8, 32)


def write_entry_points(root: Path, into: Path) -> None:
    """A ``moepage-<version>.dist-info`` in ``into`` declaring ``root``'s entry points."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    info = into / f"{project['name']}-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: 0\n")
    lines = []
    for group, entries in project.get("entry-points", {}).items():
        lines += [f"[{group}]"] + [f"{k} = {v}" for k, v in entries.items()] + [""]
    (info / "entry_points.txt").write_text("\n".join(lines))


def child() -> None:
    import copy

    import torch
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    import moepage

    dev, e, top_k, k = torch.device("cuda"), 128, 8, 64
    cfg = transformers.Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=e,
                                      num_experts_per_tok=top_k)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device(dev):
        unpaged = Qwen3MoeExperts(cfg).to(torch.bfloat16).requires_grad_(False)
    for p in unpaged.parameters():
        torch.nn.init.normal_(p, std=0.02)
    paged = copy.deepcopy(unpaged)
    moepage.wrap(paged, resident=k, backend="cuda")

    def graph(fn, n=20):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), moepage.capture_mode():
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with moepage.capture_mode(), torch.cuda.graph(g):
            for _ in range(n):
                fn()
        return g

    def replay_us(g, n=20, reps=20):
        for _ in range(3):
            g.replay()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / n)
        return statistics.median(times)

    rows = []
    with torch.no_grad():
        for t in TOKENS:
            x = torch.randn(t, 2048, device=dev, dtype=torch.bfloat16)
            idx = torch.stack([torch.randperm(k)[:top_k] for _ in range(t)]).to(dev)  # experts 0..K-1: resident
            w = torch.rand(t, top_k, device=dev, dtype=torch.bfloat16)
            equal = torch.equal(paged(x, idx, w), unpaged(x, idx, w))
            un, pg = replay_us(graph(lambda: unpaged(x, idx, w))), replay_us(graph(lambda: paged(x, idx, w)))
            rows.append(dict(tokens=t, unpaged_us=un, paged_us=pg, equal=equal))
        misses = moepage.stats(paged).total.misses
    print(json.dumps(dict(rows=rows, misses=misses)))


def ops_child() -> None:
    """The aten ops of one 100 %-hit step on the captured path, on the CPU (one token)."""
    import copy

    import torch
    import transformers
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    import moepage

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    e, top_k, k = 16, 4, 8
    cfg = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=e,
                                      num_experts_per_tok=top_k)
    cfg._experts_implementation = "batched_mm"  # direct on every device, as grouped_mm is on CUDA
    torch.manual_seed(0)
    unpaged = Qwen3MoeExperts(cfg).requires_grad_(False)
    for p in unpaged.parameters():
        torch.nn.init.normal_(p, std=0.02)
    paged = copy.deepcopy(unpaged)
    moepage.wrap(paged, resident=k, backend="torch", device_planner=True)
    x = torch.randn(1, 64)
    idx = torch.randperm(k)[:top_k][None]
    w = torch.rand(1, top_k)
    found = {}
    with torch.no_grad():
        for name, layer in (("unpaged", unpaged), ("paged", paged)):
            layer(x, idx, w)  # warm: the check and the first page-in (eager)
            with moepage.capture_mode():
                layer(x, idx, w)
                with Ops() as ops:
                    layer(x, idx, w)
            found[name] = ops.seen
    print(json.dumps(found))


def measure(root: Path, ep: Path, mode: str = "--child") -> dict:
    env = {**os.environ, "PYTHONPATH": f"{root}:{ep}", "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), mode], env=env, cwd=root,
                         capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise SystemExit(f"child on {root} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=False, help="the other tree (its moepage/ and pyproject.toml)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--ops", action="store_true", help="list each tree's aten ops of one hit step (CPU)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ops-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child()
    if args.ops_child:
        return ops_child()
    if args.before is None:
        ap.error("--before DIR is required")
    if args.ops:
        return compare_ops(args.before.resolve(), args.json)
    import torch

    from bench.common import table, write_json  # the parent only: the children run on a tree given alone on their path

    if not torch.cuda.is_available():
        print("SKIPPED: bench.kernels.hit_before_after needs a CUDA GPU")
        return
    trees = {"before": args.before.resolve(), "after": ROOT}
    results: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        eps = {}
        for name, root in trees.items():
            eps[name] = Path(tmp) / name
            write_entry_points(root, eps[name])
        for _ in range(args.rounds):
            for name, root in trees.items():
                results[name].append(measure(root, eps[name]))
    shown, rows = [], []
    for i, t in enumerate(TOKENS):
        med = {name: {key: statistics.median(r["rows"][i][key] for r in runs) for key in ("unpaged_us", "paged_us")}
               for name, runs in results.items()}
        equal = all(r["rows"][i]["equal"] for runs in results.values() for r in runs)
        un = statistics.median([med["before"]["unpaged_us"], med["after"]["unpaged_us"]])
        b, a = med["before"]["paged_us"], med["after"]["paged_us"]
        rows.append(dict(tokens=t, unpaged_us=un, before_us=b, after_us=a, equal=equal))
        shown.append({"tokens": t, "unpaged µs": f"{un:.2f}", "before µs": f"{b:.2f}", "after µs": f"{a:.2f}",
                      "before / unpaged": b / un, "after / unpaged": a / un, "after / before": a / b})
    misses = {name: [r["misses"] for r in runs] for name, runs in results.items()}
    print(table(shown))
    print(f"every output torch.equal to unpaged: {all(r['equal'] for r in rows)}; misses (must be 0): {misses}")
    write_json(args.json, dict(table=rows, raw=results))


def compare_ops(before: Path, json_out: Path | None) -> None:
    from collections import Counter

    from bench.common import table, write_json

    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, root in (("before", before), ("after", ROOT)):
            write_entry_points(root, Path(tmp) / name)
            found[name] = measure(root, Path(tmp) / name, "--ops-child")
    unpaged = len(found["after"]["unpaged"])
    print(table([{"tree": name, "aten ops, unpaged": len(ops["unpaged"]), "aten ops, paged": len(ops["paged"]),
                  "paged - unpaged": len(ops["paged"]) - len(ops["unpaged"])} for name, ops in found.items()]))
    b, a = Counter(found["before"]["paged"]), Counter(found["after"]["paged"])
    print("ops the after tree runs more often:", dict(a - b) or "none")
    print("ops the before tree runs more often:", dict(b - a) or "none")
    print(f"(the unpaged step: {unpaged} ops)")
    write_json(json_out, found)


if __name__ == "__main__":
    main()
