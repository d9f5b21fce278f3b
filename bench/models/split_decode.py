"""Decode with a CPU share (``cpu_share``) against page-in only: tokens/s of the MoE part of a decode step of
Qwen3-30B-A3B-shaped models (the ``moe_stack`` layers: residual + RMSNorm + router hook + HF ``Qwen3MoeExperts``,
random bf16 weights), K = 32 of 128 experts, eager steps (a split is planned on the host at every step).

Models: ``qwen3-8`` (8 layers, 9.7 GB of experts) and ``qwen3`` (48 layers, 58 GB). Routing: ``uniform`` (every expert
equally likely, no locality: most of a layer's routed experts miss) and ``calibrated`` (moepage's generator replaying
Qwen3-30B-A3B's measured routing statistics, locality 0.3). Host rows: ``host`` (all E in pinned host memory) and
``disk`` (H host rows a layer over a disk tier, ``--disk-models``, ``--host-rows``).

Rows per model, routing, rows and batch:
- ``unpaged``: every expert on the GPU (where it fits; the bounds' base);
- ``page-in only``: moepage as without a split (the default step: device-planned where it can);
- ``split auto``: ``cpu_share="auto"`` (the cost model measured at wrap picks each step's CPU share), and each fixed
  share of ``--shares`` (``split 0.5``); the same wrapped model, its layers' split set per run;
- ``bound: link``: unpaged + the page-in only run's missed bytes per step at the link's GB/s (one pinned 1 GiB copy);
  ``bound: link + host memory``: the same bytes at the link's plus the host memory's read GB/s (a float32 sum over
  1 GiB on the split's worker thread): what splitting the misses between the two could reach at best.

Per row: ms/step (mean; median beside), tokens/s (B / mean), misses and CPU experts per step (``moepage.stats``), max
|output - page-in only| (a split is not bit-exact; page-in only must equal unpaged: checked, the script fails
otherwise). Verdicts: split auto against page-in only at B=1 (goal: >= 1.5x where misses dominate), and the batch at
which splitting stops paying (split auto under 1.05x page-in only).

    python -m bench.models.split_decode --out DIR [--models qwen3-8,qwen3] [--routing uniform,calibrated]
        [--batch 1,2,4,8,32] [--k 32] [--shares 0.5] [--disk-models qwen3-8] [--host-rows 64] [--smoke]

Writes DIR/split_decode.{json,md}. ``--smoke``: CPU, a 2-layer model of small shapes, the torch backend, a few steps:
the logic, not speed (there the cost model splits nothing: the forced shares exercise the split)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from bench import common
from bench.common import Goal, bound_ms, guarded, num, table, versions
from bench.models.model_decode import fits, id_schedule
from bench.models.moe_stack import (
    SMOKE,
    SPECS,
    RowLoader,
    Spec,
    build,
    dense_weights,
    expert_weight,
    experts,
    kept_rows_store,
    log,
    run,
)

DEV = torch.device("cuda")  # the CPU under --smoke
MODELS = {"qwen3-8": replace(SPECS["qwen3"], name="Qwen3-30B-A3B, 8 layers", layers=8), "qwen3": SPECS["qwen3"]}
VS_PAGE_IN = Goal(">=", 1.5, "{op} {limit:.1f}x page-in only tokens/s at B=1: {verdict} ({value}x)")
PAYS = 1.05  # split auto pays where it beats page-in only by this much


def schedule(routing: str, spec: Spec, steps: int, batch: int) -> np.ndarray:
    """The router hook's ids ``[steps, layers, batch, top_k]``."""
    from moepage.planning import synthetic

    gen = (synthetic.calibrated(0.3) if routing == "calibrated" and spec.experts == 128 and spec.top_k == 8
           else synthetic.uniform(spec.layers, spec.experts, spec.top_k, 0.3 if routing == "calibrated" else 0.0))
    seq = gen.generate(steps * batch).astype(np.int64)  # the B sequences never overlap
    return id_schedule(seq, steps, batch, spec.layers)


def host_read_gbs(nbytes: int = 1 << 30) -> float:
    """GB/s the split's worker thread reads host memory at (a float32 sum over ``nbytes``, its threads)."""
    from moepage import cpu

    def timed() -> float:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        x.sum()
        start = time.perf_counter()
        for _ in range(3):
            x.sum()
        return 3 * nbytes / (time.perf_counter() - start) / 1e9

    return cpu.worker(DEV).submit(timed).result()


class DiskLoader:
    """``wrap(load=)`` over a disk tier: each tensor's E rows drawn as ``RowLoader`` draws them, written to disk."""

    def __init__(self, spec: Spec):
        self.spec = spec

    def __call__(self, store, layers: dict) -> None:
        for name, specs in layers.items():
            for n in specs:
                store.write_rows(name, n, expert_weight(self.spec, int(name.split(".")[1]), n, DEV).cpu())


@contextlib.contextmanager
def sharing(model, share):
    """Inside, every paged layer of ``model`` splits with ``share`` (None: page-in only, as a layer wrapped without
    ``cpu_share``; its costs kept)."""
    import moepage

    pagers = [layer.pager for layer in moepage.paged_layers(model)]
    saved = [(p.split, p.split.share if p.split is not None else None) for p in pagers]
    try:
        for p in pagers:
            if share is None:
                p.split = None
            else:
                p.split.share = share
        yield
    finally:
        for p, (split, was) in zip(pagers, saved):
            p.split = split
            if split is not None:
                split.share = was


class SplitBench:
    """The rows of one model: its schedules and inputs, the unpaged and page-in only references."""

    def __init__(self, key: str, spec: Spec, args, link: float, host: float, rows: list[dict]):
        self.key, self.spec, self.args, self.link, self.host, self.rows = key, spec, args, link, host, rows
        self.n = args.warmup + args.steps
        g = torch.Generator(device=DEV).manual_seed(11)
        self.xs = {b: torch.randn((self.n, b, spec.hidden), generator=g, device=DEV, dtype=torch.bfloat16)
                   for b in args.batch}
        self.dense = dense_weights(spec, False, DEV)
        self.ids = {(r, b): self._pinned(torch.from_numpy(schedule(r, spec, self.n, b)))
                    for r in args.routing for b in args.batch}
        self.unpaged_ms: dict = {}
        self.refs: dict = {}  # (routing, tier, batch) -> page-in only outputs
        self.errors: list[str] = []

    @staticmethod
    def _pinned(t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if DEV.type == "cuda" else t

    def row(self, run_name: str, routing: str, tier: str, b: int, res: dict, **extra) -> dict:
        row = dict(model=self.spec.name, routing=routing, rows=tier, batch=b, run=run_name, **res, **extra)
        if row.get("ms"):
            row["tok_s"] = b * 1e3 / row["ms"]
        self.rows.append(row)
        return row

    def unpaged(self) -> None:
        if DEV.type == "cuda" and fits(self.spec, self.spec.layers) < self.spec.layers:
            log(f"{self.spec.name}: the unpaged model does not fit: no unpaged rows nor bounds")
            return
        model = build(self.dense, lambda i: experts(self.spec, i, DEV))
        for r in self.args.routing:
            for b in self.args.batch:
                res, hist = run(model, self.ids[r, b], self.xs[b], self.args.warmup, self.args.steps, graph=False)
                self.unpaged_ms[r, b] = res["ms"]
                self.refs[r, "unpaged", b] = hist
                self.row("unpaged", r, "-", b, res)
                log(f"  unpaged {r} B={b}: {res['ms']:.3f} ms/step")
        del model
        gc.collect()
        torch.cuda.empty_cache() if DEV.type == "cuda" else None

    def wrap(self, tier: str, spill: Path | None):
        import moepage

        t0 = time.perf_counter()
        model = build(self.dense, lambda i: experts(self.spec))
        if tier == "host":
            moepage.wrap(model, resident=self.args.k, backend=kept_rows_store(DEV), device=DEV,
                         load=RowLoader(self.spec, DEV), cpu_share="auto")
        else:
            moepage.wrap(model, resident=self.args.k, device=DEV, load=DiskLoader(self.spec), cpu_share="auto",
                         host_budget=self.args.host_rows, spill_dir=spill,
                         backend="torch" if DEV.type != "cuda" else None)
        costs = next(moepage.paged_layers(model)).pager.split.costs
        log(f"{self.spec.name}: wrapped at K={self.args.k} ({tier} rows) in {time.perf_counter() - t0:.1f} s; "
            f"measured: page-in {costs.page_seconds * 1e3:.3f} ms an expert, CPU "
            + ", ".join(f"{t} tok {s * 1e3:.3f} ms" for t, s in zip(costs.tokens, costs.cpu_seconds) if t in (1, 8, 32))
            + f", fixed {costs.fixed_seconds * 1e3:.3f} ms")
        return model, costs

    def paged(self, tier: str) -> None:
        spill = Path(tempfile.mkdtemp(prefix="split-", dir=self.args.spill_root)) if tier == "disk" else None
        model, costs = self.wrap(tier, spill)
        runs = [("page-in only", None), ("split auto", "auto"), *((f"split {s:g}", s) for s in self.args.shares)]
        try:
            for r in self.args.routing:
                for b in self.args.batch:
                    for run_name, share in runs:
                        guarded(self.errors, f"{self.spec.name} {r} {tier} B={b} {run_name}", self.timed, model,
                                run_name, share, r, tier, b)
        finally:
            del model
            gc.collect()
            if spill is not None:
                shutil.rmtree(spill, ignore_errors=True)
        self.costs = dict(page_ms=costs.page_seconds * 1e3, fixed_ms=costs.fixed_seconds * 1e3,
                          cpu_ms=dict(zip(map(str, costs.tokens), (s * 1e3 for s in costs.cpu_seconds))))

    def timed(self, model, run_name: str, share, r: str, tier: str, b: int) -> None:
        import moepage

        counts: list[tuple[int, int]] = []

        def misses() -> float:  # read at the first timed step and after the last
            total = moepage.stats(model).total
            counts.append((total.misses, total.cpu))
            return float(total.misses)

        with sharing(model, share):
            res, hist = run(model, self.ids[r, b], self.xs[b], self.args.warmup, self.args.steps, misses, graph=False)
        (m0, c0), (m1, c1) = counts[0], counts[-1]
        res["misses_step"], res["cpu_step"] = (m1 - m0) / res["steps"], (c1 - c0) / res["steps"]
        extra = {}
        if share is None:
            self.refs[r, tier, b] = hist
            want = self.refs.get((r, "unpaged", b))
            extra["equal_unpaged"] = None if want is None else bool(torch.equal(hist, want))
            base = self.unpaged_ms.get((r, b))
            if base is not None:
                missed = res["misses_step"] * self.spec.expert_bytes
                self.row("bound: link", r, tier, b, dict(ms=bound_ms(base, missed, self.link)))
                self.row("bound: link + host memory", r, tier, b,
                         dict(ms=bound_ms(base, missed, self.link + self.host)))
        else:
            ref = self.refs.get((r, tier, b))
            extra["max_abs_diff"] = None if ref is None else (hist.float() - ref.float()).abs().max().item()
            page = next((x for x in self.rows if x["run"] == "page-in only" and x["routing"] == r
                         and x["rows"] == tier and x["batch"] == b and x["model"] == self.spec.name), None)
            extra["x_page_in"] = None if page is None else page["ms"] / res["ms"]
        self.row(run_name, r, tier, b, res, **extra)
        gain = "" if "x_page_in" not in extra else f", {num(extra['x_page_in'])}x page-in only"
        log(f"  {run_name} {r} {tier} B={b}: {res['ms']:.3f} ms/step, misses {res['misses_step']:.1f} + CPU "
            f"{res['cpu_step']:.1f} a step{gain}")


def verdicts(rows: list[dict]) -> list[str]:
    """Split auto against page-in only at B=1, and the batch at which splitting stops paying, per model, routing and
    rows."""
    out = []
    groups = sorted({(r["model"], r["routing"], r["rows"]) for r in rows if r["run"] == "split auto"})
    for model, routing, tier in groups:
        auto = sorted((r for r in rows if r["run"] == "split auto" and (r["model"], r["routing"], r["rows"])
                       == (model, routing, tier) and r.get("x_page_in")), key=lambda r: r["batch"])
        where = f"{model}, {routing} routing, {tier} rows"
        one = next((r for r in auto if r["batch"] == 1), None)
        if one is not None:
            out.append(VS_PAGE_IN.line(where, one["x_page_in"]))
        stops = next((r["batch"] for r in auto if r["x_page_in"] < PAYS), None)
        said = "pays at every batch measured" if stops is None else f"stops paying at B={stops}"
        each = ", ".join(f"B={r['batch']} {r['x_page_in']:.2f}x" for r in auto)
        out.append(f"- {where}: splitting {said} (split auto / page-in only: {each})")
    return out


def markdown(rows: list[dict]) -> str:
    return table([{
        "model": r["model"], "routing": r["routing"], "rows": r["rows"], "B": r["batch"], "run": r["run"],
        "ms/step": num(r.get("ms")), "median": num(r.get("ms_median")), "tok/s": num(r.get("tok_s"), ".1f"),
        "x page-in only": num(r.get("x_page_in"), ".2f"), "misses + CPU / step":
            f"{num(r.get('misses_step'), '.1f')} + {num(r.get('cpu_step'), '.1f')}",
        "max \\|Δ\\| vs page-in only": num(r.get("max_abs_diff"), ".3g"),
        "= unpaged": {True: "yes", False: "NO", None: "-"}[r.get("equal_unpaged")],
    } for r in rows])


def report(out: Path, note: str, rows: list[dict], errors: list[str], costs: dict) -> str:
    out.mkdir(parents=True, exist_ok=True)
    lines = verdicts(rows) + [f"- ERROR {e}" for e in errors]
    md = f"{note}\n\n{markdown(rows)}\n\nVerdicts:\n" + "\n".join(lines)
    (out / "split_decode.md").write_text(md + "\n")
    common.write_json(out / "split_decode.json", dict(note=note, rows=rows, verdicts=lines, costs=costs))
    return md


def main(argv: list[str] | None = None) -> int:
    """Runs the bench; returns 0, or 1 where page-in only differed from unpaged or a run failed."""
    global DEV
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="qwen3-8,qwen3")
    ap.add_argument("--routing", default="uniform,calibrated")
    ap.add_argument("--batch", default="1,2,4,8,32")
    ap.add_argument("--k", type=int, default=32, help="resident experts per layer")
    ap.add_argument("--shares", default="0.5", help="fixed CPU shares timed beside auto ('' for none)")
    ap.add_argument("--disk-models", default="qwen3-8", help="models also run over a disk tier ('' for none)")
    ap.add_argument("--host-rows", type=int, default=64, help="host rows a layer with the disk tier (K <= H <= E)")
    ap.add_argument("--spill-root", default=None, help="where the disk tier's folders go (default: the temp dir)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny model, torch backend: logic only")
    args = ap.parse_args(argv)
    split_list = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    args.batch = [int(x) for x in split_list(args.batch)]
    args.routing, args.shares = split_list(args.routing), [float(x) for x in split_list(args.shares)]
    models, disk = split_list(args.models), set(split_list(args.disk_models))
    if args.smoke:
        models, disk = ["smoke"], {"smoke"} if args.disk_models else set()
        args.k, args.host_rows = min(args.k, 6), min(args.host_rows, 10)
        args.steps, args.warmup, args.shares = min(args.steps, 3), min(args.warmup, 2), args.shares or [0.5]
        args.batch = [b for b in args.batch if b <= 4] or [1]
    elif not torch.cuda.is_available():
        print("split_decode: skipped: no CUDA device (--smoke runs the logic on CPU)")
        return 0
    DEV = torch.device("cpu") if args.smoke else torch.device("cuda")
    link = 50.0 if args.smoke else common.memcpy_gbs()
    host = host_read_gbs(1 << 26 if args.smoke else 1 << 30)
    device = f"CPU smoke ({versions()})" if args.smoke else versions()
    note = (f"Decode step = the MoE part only; K={args.k}; eager steps, {args.steps} timed after {args.warmup} "
            f"warm-up; link {link:.1f} GB/s{' (assumed)' if args.smoke else ''} (pinned 1 GiB copy), host memory read "
            f"{host:.1f} GB/s (the split's worker); disk tier: {args.host_rows} host rows a layer; {device}")
    log(note)
    rows, errors, costs = [], [], {}
    md = ""
    with torch.no_grad():
        for key in models:
            spec = SMOKE if key == "smoke" else MODELS[key]
            bench = SplitBench(key, spec, args, link, host, rows)
            guarded(errors, f"{spec.name} unpaged", bench.unpaged)
            for tier in ("host", "disk") if key in disk else ("host",):
                guarded(errors, f"{spec.name} {tier}", bench.paged, tier)
                costs[f"{spec.name} ({tier})"] = getattr(bench, "costs", None)
            errors += bench.errors
            md = report(args.out, note, rows, errors, costs)  # after each model: a run cut short keeps it
    print("\n" + md)
    wrong = [f"{r['model']} {r['routing']} {r['rows']} B={r['batch']}" for r in rows if r.get("equal_unpaged") is False]
    if wrong or errors:
        print(f"split_decode: FAILED: page-in only differs from unpaged in {wrong}; errors {errors}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

