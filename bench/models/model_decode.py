"""Whole-model captured decode (issue 12 item 4): tokens/s of a paged MoE model against unpaged,
the physics bound and SGLang's paged-experts mechanism, with exactness checked at every step.

Models (random bf16 weights). Each layer is residual + RMSNorm + router hook + HF ``Qwen3MoeExperts``
(``grouped_mm``). Attention is omitted, so this is the MoE part of a decode step; ``--attn-proxy``
adds the attention projections' weight reads as two matmuls.
- ``qwen3``: Qwen3-30B-A3B-shaped, 48 layers, E=128, top-8, H=2048, I=768: 57.98 GB of experts.
  Routed by moepage's Qwen3-calibrated synthetic generator, locality rho=0.3.
- ``granite``: Granite-3.0-1B-A400M-shaped, 24 layers, E=32, top-8, H=1024, I=512: 2.42 GB.
  Routed by the real Granite trace: its three prompts' 192 decode steps, cyclic.

Router hook (bench only). The top-k ids come from the trace through a static device buffer. The
host refills it from pinned memory (non_blocking) before each step. The router weights are the
softmax of the hidden state's router logits at those ids, so outputs depend on the data. Batch B
decodes B sequences, at offsets b * len / B into the trace.

Rows, for each batch size:
- ``unpaged``: all experts on the GPU;
- ``moepage``: ``moepage.wrap(model, resident=K)``, cuda backend, at each K/E;
- ``bound``: the unpaged step plus the moepage run's missed bytes per step, at the bandwidth of
  one pinned cudaMemcpyAsync of >= 256 MB measured in this run;
- ``sglang``: SGLang 0.5.23's ``paged_experts_decide`` and ``paged_experts_gather`` driving the same
  slots and host rows, as its ``DeviceExecutor`` does: decide, gather, ids -> slots, then the
  experts module's own forward on the K slots. Only where sglang imports.
- ``unpaged again``: the unpaged run repeated last, to show order effects.

Each configuration's decode step (all layers) is ONE CUDA graph, replayed once per token:
``--warmup`` replays, then ``--steps`` timed with CUDA events. ms/step is the mean (tokens/s =
B / mean, since per-step work varies with misses; the bound uses mean misses too); the median is
shown beside it. If capture raises (e.g. B x top_k > K on a core without captured multi-wave
decode), the row says so and is timed eagerly over fewer steps.

Exactness: each paged step's output is compared ``torch.equal`` to the unpaged output of the same
step. A difference fails the script (exit 1), after every row has been written.

Memory (qwen3, 48 layers): the unpaged run holds its 58 GB of experts on the GPU; afterwards only
its per-step outputs (kilobytes) stay, and the experts are freed. The host rows are then pinned
once (cuMemHostAlloc, exact: 58 GB of the 128 GiB) and filled from the same seeded generator (drawn
on the GPU, copied down). Every K/E wraps a fresh model over those rows and releases its slots
after. So the GPU holds either the unpaged experts or K slots per layer (<= 58 GB), never both;
``unpaged again`` rebuilds the experts on the GPU after the host rows are freed. With less free
GPU memory or host RAM, the layers are capped (said in the log).

    python -m bench.models.model_decode --out DIR [--model qwen3|granite|both] [--layers N] [--steps 64]
        [--warmup 32] [--batch 1,8] [--kfrac 0.25,0.5,0.75,1.0] [--quick] [--attn-proxy] [--smoke]

``--smoke`` needs no GPU: a 2-layer model with small shapes, run eagerly on CPU with the torch
backend, and SGLang's rows on a torch reference of its kernels. It checks the logic, not speed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from bench import common
from bench.common import Goal, bound_ms, guarded, memcpy_gbs, num, paging_config, table, versions
from bench.kernels.sglang_kernels import SglangPager, sglang_ops, torch_reference_ops
from bench.models.moe_stack import (
    PARAMS,
    SMOKE,
    SPECS,
    MoEStack,
    RowLoader,
    SglangExperts,
    Spec,
    build,
    dense_weights,
    experts,
    first_difference,
    kept_rows_store,
    log,
    run,
    slot_experts,
)

DEV = torch.device("cuda")  # torch.device("cpu") under --smoke
# The three goals: tokens/s against unpaged (at K/E = 1), step time against the bound, against SGLang's.
VS_UNPAGED = Goal(">=", 0.95, "{op} {limit:.2f}x unpaged tokens/s: {verdict} ({value}x)")
VS_BOUND = Goal("<=", 1.10, "{op} {limit:.2f}x the bound's step time: {verdict} ({value}x)")
VS_SGLANG = Goal(">", 1.0, "ahead of SGLang's mechanism: {verdict} ({value}x its tokens/s)")
SKIPPING = "moepage, empty waves skipped"  # the run whose captures skip empty waves (graph if-nodes)
OVERLAPPED = "moepage, overlapped waves"  # the run whose captured steps of more than K take overlapped waves of K // 2
VARIANTS = {SKIPPING: dict(skip_empty_waves=True), OVERLAPPED: dict(decode_overlap=True)}  # run -> PagingConfig fields


# -- routing and accounting (pure Python) -------------------------------------------------------------
def granite_sequence() -> np.ndarray:
    """The real Granite decode trace, the three prompts one after the other: ``[192, 24, 8]``."""
    from bench.data.traces import GRANITE, SHARED

    d = json.loads((SHARED / GRANITE).read_text())
    return np.concatenate([np.asarray(p["decode"], dtype=np.int64) for p in d["prompts"].values()])


def id_schedule(seq: np.ndarray, steps: int, batch: int, layers: int) -> np.ndarray:
    """The router hook's ids ``[steps, layers, batch, top_k]``: sequence b of the batch reads ``seq``
    (``[tokens, >= layers, top_k]``, cyclic) from offset ``b * tokens // batch``."""
    n = seq.shape[0]
    rows = (np.arange(steps)[:, None] + (np.arange(batch) * n // batch)[None, :]) % n
    return np.ascontiguousarray(seq[rows][:, :, :layers].transpose(0, 2, 1, 3))


def predicted_misses(sched: np.ndarray, num_experts: int, k: int, first: int, last: int) -> float | None:
    """Misses per step over steps ``first..last-1`` (summed over layers), as moepage's host planner
    counts them replaying the same ids from the start with slots holding experts 0..K-1
    (``moepage.planning.traces.replay``): a prediction beside the device counters; None without that API."""
    try:
        from moepage.planning import traces

        def misses(n: int) -> int:
            if n == 0:
                return 0
            trace = traces.from_array("schedule", sched[:n].reshape(n, sched.shape[1], -1), num_experts,
                                      sched.shape[-1])
            return traces.replay(trace, k, "lru", warm=True).misses

        return (misses(last) - misses(first)) / (last - first)
    except Exception as exc:  # noqa: BLE001
        log(f"  no host prediction of the misses: {type(exc).__name__}: {exc}")
        return None


def goals(rows: list[dict]) -> list[str]:
    """The issue's three goals, per model, batch and K/E, stated as met or not, with numbers."""
    out = []
    for r in (r for r in rows if r["run"] == "moepage"):
        where = f"{r['model']} B={r['batch']} K/E={r['k_over_e']:.2f}"
        peer = lambda run: next((x for x in rows if x["run"] == run and x["model"] == r["model"]  # noqa: E731
                                 and x["batch"] == r["batch"] and x["k_over_e"] in (r["k_over_e"], None)), None)
        if r["mode"] != "graph" or r.get("ms") is None:
            out.append(f"- {where}: not met (not captured: {r['mode']})")
            continue
        un, bound, sgl = peer("unpaged"), peer("bound"), peer("sglang")
        if r["k_over_e"] == 1.0 and un:
            out.append(VS_UNPAGED.line(where, un["ms"] / r["ms"]))
        if bound:
            out.append(VS_BOUND.line(where, r["ms"] / bound["ms"]))
        for variant, what in ((SKIPPING, "skipping empty waves"), (OVERLAPPED, "overlapped waves of K // 2")):
            v = peer(variant)
            if v and v.get("ms") is not None:
                out.append(f"- {where}: {what}: {r['ms'] / v['ms']:.3f}x the tokens/s of the default step"
                           + ("" if not bound else f", {v['ms'] / bound['ms']:.3f}x the bound"))
        if sgl and sgl.get("ms") is not None:
            out.append(VS_SGLANG.line(where, sgl["ms"] / r["ms"]))
        elif sgl:
            out.append(f"- {where}: vs SGLang's mechanism: no figure ({sgl['mode']})")
    return out


def markdown(rows: list[dict]) -> str:
    return table([{
        "model": r["model"], "B": r["batch"], "run": r["run"], "K/E": num(r["k_over_e"], ".2f"), "K": r.get("k") or "-",
        "mode": r["mode"], "ms/step": num(r.get("ms")), "median": num(r.get("ms_median")),
        "tok/s": num(r.get("tok_s"), ".1f"), "x unpaged": num(r.get("vs_unpaged")),
        "misses/step (device / host replay)": f"{num(r.get('misses_step'), '.1f')} / "
                                              f"{num(r.get('host_misses_step'), '.1f')}",
        "x bound": num(r.get("vs_bound")),
        "equal": {True: "yes", False: f"NO (step {r.get('first_bad')})", None: "-"}[r.get("equal")],
    } for r in rows])


def device_misses(model):
    import moepage

    def read() -> float:
        return float(moepage.stats(model).total.misses)

    try:
        read()
        return read
    except Exception as exc:  # noqa: BLE001 - the host LRU prediction stands in
        log(f"  moepage.stats unavailable ({type(exc).__name__}: {exc}); bound from the host LRU prediction")
        return None


class ModelBench:
    """Every row of one model: its schedules, inputs and dense weights, the unpaged references."""

    def __init__(self, key: str, spec: Spec, args, link_gbs: float, sgl, rows: list[dict]):
        self.spec, self.args, self.link, self.sgl, self.rows = spec, args, link_gbs, sgl, rows
        n = args.warmup + args.steps
        if key == "granite":
            seq = granite_sequence()
        else:
            from moepage.planning import synthetic

            gen = (synthetic.calibrated(0.3) if key == "qwen3"
                   else synthetic.uniform(spec.layers, spec.experts, spec.top_k, 0.3))
            seq = gen.generate(n * max(args.batch)).astype(np.int64)  # the B sequences never overlap
        self.scheds = {b: id_schedule(seq, n, b, spec.layers) for b in args.batch}
        self.ids = {b: torch.from_numpy(s).pin_memory() if DEV.type == "cuda" else torch.from_numpy(s)
                    for b, s in self.scheds.items()}
        g = torch.Generator(device=DEV).manual_seed(11)
        self.xs = {b: torch.randn((n, b, spec.hidden), generator=g, device=DEV, dtype=torch.bfloat16)
                   for b in args.batch}
        self.dense = dense_weights(spec, args.attn_proxy, DEV)
        self.refs, self.unpaged_res, self.errors = {}, {}, []
        self.names = [f"layers.{i}.experts" for i in range(spec.layers)]

    def add(self, run_name: str, b: int, res: dict, k: int | None = None, **extra) -> dict:
        kfrac = None if k is None else k / self.spec.experts
        row = dict(model=self.spec.name, layers=self.spec.layers, batch=b, run=run_name, k_over_e=kfrac, k=k,
                   **res, **extra)
        if row.get("ms"):
            row["tok_s"] = b * 1e3 / row["ms"]
            row["vs_unpaged"] = self.unpaged_res[b]["ms"] / row["ms"] if b in self.unpaged_res else None
        self.rows.append(row)
        return row

    def timed(self, run_name: str, model: MoEStack, b: int, k: int | None = None, misses=None, graph: bool = True,
              **extra) -> dict:
        """Run, check every step against the unpaged outputs, add the row."""
        res, hist = run(model, self.ids[b], self.xs[b], self.args.warmup, self.args.steps, misses, graph)
        if b not in self.refs:  # the first unpaged run is the reference
            self.refs[b], self.unpaged_res[b] = hist, res
            bad = None if bool(torch.isfinite(hist).all()) else "non-finite output"
            equal = None if bad is None else False
        else:
            bad = first_difference(hist, self.refs[b])
            equal = bad is None
        row = self.add(run_name, b, res, k, equal=equal, first_bad=bad, **extra)
        log(f"  {run_name}{'' if k is None else f' K={k}'} B={b}: {res['ms']:.3f} ms/step ({res['mode']}), "
            f"equal {equal}")
        return row

    def guarded(self, what: str, fn, *args):
        return guarded(self.errors, f"{self.spec.name} {what}", fn, *args)

    def wrap(self, store, loader: RowLoader, k: int, policy: str) -> MoEStack:
        import moepage

        t0 = time.perf_counter()
        model = build(self.dense, lambda i: experts(self.spec))
        moepage.wrap(model, resident=k, backend=store, device=DEV, load=loader, policy=policy)
        if loader.filled_gb:
            log(f"{self.spec.name}: host rows allocated (pinned on CUDA) in {loader.started - t0:.1f} s, "
                f"{loader.filled_gb:.2f} GB filled in {loader.seconds:.1f} s; wrap at K={k}: "
                f"{time.perf_counter() - t0:.1f} s in all")
            loader.filled_gb = 0.0
        else:
            log(f"{self.spec.name}: K={k}: wrapped over the kept host rows in {time.perf_counter() - t0:.1f} s")
        return model

    def unpaged(self, name: str) -> None:
        t0 = time.perf_counter()
        model = build(self.dense, lambda i: experts(self.spec, i, DEV))
        log(f"{self.spec.name}: {name}: {self.spec.layers} layers of experts made on {DEV.type} "
            f"({self.spec.layers * self.spec.experts * self.spec.expert_bytes / 1e9:.2f} GB) "
            f"in {time.perf_counter() - t0:.1f} s")
        for b in self.args.batch:
            self.timed(name, model, b)

    def moepage(self, model: MoEStack, k: int, run_name: str = "moepage") -> None:
        for b in self.args.batch:
            res = self.timed(run_name, model, b, k, device_misses(model))
            w = res["warmup"]
            res["host_misses_step"] = predicted_misses(self.scheds[b], self.spec.experts, k, w, w + res["steps"])
            per_step = res.get("misses_step", res["host_misses_step"])
            if per_step is None:
                raise RuntimeError("no miss count (moepage.stats and moepage.planning.traces.replay both failed): "
                                   "no bound")
            missed = per_step * self.spec.expert_bytes
            bound = bound_ms(self.unpaged_res[b]["ms"], missed, self.link)
            res["vs_bound"] = res["ms"] / bound
            self.add("bound" if run_name == "moepage" else f"bound ({run_name})", b,
                     dict(mode="unpaged + missed bytes / memcpy", ms=bound), k)
            log(f"    bound {bound:.3f} ms/step; misses/step {num(res.get('misses_step'), '.2f')} (moepage.stats), "
                f"{num(res['host_misses_step'], '.2f')} (moepage's host planner replaying the ids)")
            if self.args.eager and run_name == "moepage":  # the same steps without the graph
                eager = self.timed("moepage eager", model, b, k, device_misses(model), graph=False)
                eager["graph_speedup"] = eager["ms"] / res["ms"]

    def sglang(self, store, k: int) -> None:
        """SGLang's mechanism over the same host rows and slots (after moepage's runs of this K)."""
        model = None
        for b in self.args.batch:
            if isinstance(self.sgl, str) or b * self.spec.top_k > k:
                why = (self.sgl if isinstance(self.sgl, str)
                       else f"n/a: SGLang decides <= K={k} entries a step (graphs of B <= K // top_k)")
                self.add("sglang", b, dict(mode=why), k)
                continue
            if model is None:
                pagers = [SglangPager(self.sgl, [store.host_rows(nm, p) for p in PARAMS],
                                      [store.slots(nm, p) for p in PARAMS], self.spec.experts) for nm in self.names]
                model = build(self.dense,
                              lambda i: SglangExperts(slot_experts(self.spec, store, self.names[i], k), pagers[i]))
            for p in pagers:
                p.reset()  # slots 0..K-1 hold experts 0..K-1 again, as at moepage's start
            row = self.timed("sglang", model, b, k)
            bound = next((r["ms"] for r in self.rows if r["run"] == "bound" and r["batch"] == b and r["k"] == k
                          and r["model"] == self.spec.name), None)
            row["vs_bound"] = None if bound is None else row["ms"] / bound


def bench_model(key: str, spec: Spec, args, link_gbs: float, sgl, rows: list[dict]) -> list[str]:
    """Appends the model's rows to ``rows``; returns its errors. Memory: see the docstring."""
    mb = ModelBench(key, spec, args, link_gbs, sgl, rows)
    mb.unpaged("unpaged")
    gc.collect()
    torch.cuda.empty_cache() if DEV.type == "cuda" else None
    store, loader = kept_rows_store(DEV), RowLoader(spec, DEV)
    for kfrac in args.kfrac:
        k = int(kfrac * spec.experts + 0.5)
        # The default policy's rows are "moepage" (and its bound); others are "moepage <policy>"; with
        # --skip-empty-waves / --decode-overlap the default policy's steps captured so (VARIANTS), side by side.
        runs = [(p, "moepage" if i == 0 else f"moepage {p}") for i, p in enumerate(args.policies)]
        runs += [(args.policies[0], SKIPPING)] if args.skip_empty_waves else []
        runs += [(args.policies[0], OVERLAPPED)] if args.decode_overlap else []
        for i, (policy, run_name) in enumerate(runs):
            model = mb.guarded(f"wrap K={k} {policy}", mb.wrap, store, loader, k, policy)
            if model is not None:
                with paging_config(model, **VARIANTS[run_name]) if run_name in VARIANTS else contextlib.nullcontext():
                    mb.guarded(f"{run_name} K={k}", mb.moepage, model, k, run_name)
                if i == 0:
                    mb.guarded(f"sglang K={k}", mb.sglang, store, k)  # on moepage's slots: after its runs
            for nm in mb.names:
                store.release(nm)
            del model
            gc.collect()
            torch.cuda.empty_cache() if DEV.type == "cuda" else None
    store.close()
    mb.guarded("unpaged again", mb.unpaged, "unpaged again")
    return mb.errors


def fits(spec: Spec, layers: int) -> int:
    """Layers whose experts fit both the free GPU memory and the available host RAM (5 % spare)."""
    per_layer = spec.experts * spec.expert_bytes
    with open("/proc/meminfo") as f:
        host = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    gpu = torch.cuda.mem_get_info()[0] - (4 << 30)
    return max(1, min(layers, int(min(gpu, host - (8 << 30)) / 1.05 // per_layer)))


def plot(rows: list[dict], path: Path) -> None:
    panels = sorted({(r["model"], r["batch"]) for r in rows})
    fig, axes = common.figure(len(panels), (4.5, 3.6))
    for ax, (model, b) in zip(axes, panels):
        rs = [r for r in rows if r["model"] == model and r["batch"] == b and r.get("tok_s")]
        for run_name, style in (("moepage", "o-"), ("sglang", "s-"), ("bound", "k--")):
            pts = [(r["k_over_e"], r["tok_s"]) for r in rs
                   if r["run"] == run_name and r["mode"].startswith(("graph", "unpaged"))]
            ax.plot(*zip(*pts), style, label=run_name) if pts else None
        eager = [(r["k_over_e"], r["tok_s"]) for r in rs if r["run"] == "moepage" and r["mode"].startswith("eager")]
        ax.plot(*zip(*eager), "rx", label="moepage, eager (not captured)") if eager else None
        for r in (r for r in rs if r["run"] == "unpaged"):
            ax.axhline(r["tok_s"], color="g", label="unpaged")
        ax.set(title=f"{model}, batch {b}", xlabel="K / E", ylabel="decode tokens/s (MoE part)", yscale="log")
        ax.legend(fontsize=7)
    common.save(fig, path)


def main() -> None:
    global DEV
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", choices=("qwen3", "granite", "both"), default="both")
    ap.add_argument("--layers", type=int, help="at most this many layers per model (default: all that fit)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--kfrac", default="0.25,0.5,0.75,1.0")
    ap.add_argument("--policies", default="lfu,lru",
                    help="eviction policies, the first as 'moepage' (default: moepage's default, then LRU)")
    ap.add_argument("--skip-empty-waves", action="store_true",
                    help="also the default policy's steps captured skipping empty waves (MOEPAGE_SKIP_EMPTY_WAVES=on)")
    ap.add_argument("--decode-overlap", action="store_true",
                    help="also the default policy's captured steps of more than K in overlapped waves of K // 2 "
                         "(MOEPAGE_DECODE_OVERLAP=on)")
    ap.add_argument("--quick", action="store_true", help="--steps 16 --warmup 8")
    ap.add_argument("--eager", action="store_true", help="also time moepage's steps eagerly (graph vs eager)")
    ap.add_argument("--attn-proxy", action="store_true", help="add the attention projections' matmuls per layer")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny model, eager, torch backend: logic only")
    args = ap.parse_args()
    args.batch = [int(x) for x in args.batch.split(",")]
    args.kfrac = [float(x) for x in args.kfrac.split(",")]
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.quick:
        args.steps, args.warmup = 16, 8
    if args.smoke:
        DEV = torch.device("cpu")
        args.steps, args.warmup = min(args.steps, 4), min(args.warmup, 3)
    elif not torch.cuda.is_available():
        print("model_decode: skipped: no CUDA device (--smoke runs the logic on CPU)")
        return
    sgl = torch_reference_ops() if args.smoke else sglang_ops()
    link = 50.0 if args.smoke else memcpy_gbs()
    device = f"CPU smoke ({versions()})" if args.smoke else versions()
    sgl_line = sgl if isinstance(sgl, str) else f"sglang {sgl.version}, kernels built in {sgl.build_s:.1f} s"
    log(f"{device}; pinned H2D memcpy (1 GiB): {link:.1f} GB/s{' (assumed)' if args.smoke else ''}; SGLang: {sgl_line}")
    rows, errors = [], []
    keys = ["smoke"] if args.smoke else ["qwen3", "granite"] if args.model == "both" else [args.model]
    note = ("Decode step = the MoE part only "
            f"(attention omitted{'; its projections proxied' if args.attn_proxy else ''});"
            f" {args.steps} timed steps after {args.warmup} warm-up; bound link {link:.1f} GB/s; {device}; "
            f"SGLang: {sgl_line}")
    with torch.no_grad():
        for key in keys:
            spec = SMOKE if key == "smoke" else SPECS[key]
            layers = min(args.layers or spec.layers, spec.layers)
            if DEV.type == "cuda" and fits(spec, layers) < layers:
                log(f"{spec.name}: only {fits(spec, layers)} of {layers} layers fit GPU and host memory: capped")
                layers = fits(spec, layers)
            try:
                errors += bench_model(key, replace(spec, layers=layers), args, link, sgl, rows)
            except Exception as exc:  # noqa: BLE001 - the other model still runs; exit 1 at the end
                import traceback

                traceback.print_exc()
                errors.append(f"{spec.name}: {type(exc).__name__}: {exc}")
            md = report(rows, errors, note, args.out)  # after each model: a run cut short keeps it
    print("\n" + md)
    unequal = [f"{r['model']} B={r['batch']} {r['run']} K/E={r['k_over_e']}" for r in rows if r.get("equal") is False]
    if unequal or errors:
        sys.exit(f"model_decode: FAILED: outputs differ from unpaged in {unequal}; errors {errors}")


def report(rows: list[dict], errors: list[str], note: str, out: Path) -> str:
    """Writes model_decode.{md,json,png} under ``out``; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    verdicts = goals(rows) + [f"- ERROR {e}" for e in errors]
    md = f"{note}\n\n{markdown(rows)}\n\nGoals:\n" + "\n".join(verdicts)
    (out / "model_decode.md").write_text(md + "\n")
    common.write_json(out / "model_decode.json", dict(note=note, rows=rows, goals=verdicts))
    if rows:
        plot(rows, out / "model_decode.png")
    return md


if __name__ == "__main__":
    main()
