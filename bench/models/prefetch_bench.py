"""Next-layer prefetch on a trained Qwen3-MoE (issue 15): captured decode tokens/s with prefetch off
and on, critical-path misses, the predictor's recall, the physics bound, exactness.

The model is ``bench/models/train_moe.py``'s ``h200`` preset (8 layers, E = 64, top-4, 4.7 MB per expert
in bf16), loaded from ``--ckpt``; ``--train-minutes N`` trains it there first when it is missing
(in-process, ``train_moe.train``). Every run is in this one process, so the unpaged figures, the
link rate and the paged rows come from the same machine state.

Decode. Prompts are held-out text: evenly spaced windows of the val split (``train_moe.corpus``),
``--prompt`` bytes each, one window per sequence of the batch. After an eager prefill into a
static cache (``tests/decode_loop.py``'s ``StaticDecode``), ``--steps`` decode steps run, each one
replay of one captured CUDA graph of the whole model step. By default the steps are
**teacher-forced**: step i's input is the held-out text's next byte, so the routing is that of real
text and every configuration computes exactly the same steps (``--mode greedy`` feeds the argmax
instead). A repetition is prefill + steps; ``--warmup`` repetitions, then ``--reps`` timed by CUDA
events around the steps alone; ms/step is the median repetition's mean.

Rows, for each batch size (``--batch``, default 1 and 8):
- ``unpaged``: every expert on the GPU (and ``unpaged again`` at the end: order effects);
- ``moepage``: ``moepage.wrap(copy, resident=K, backend="cuda", prefetch=P)`` for K/E in ``--kfrac``
  and P in ``--prefetch`` (``off``; ``true``: the next layer's router, top-k; ``2k``: its top-2k);
  the counters are ``moepage.stats`` deltas over the timed steps: ``misses`` (paged by the step
  itself: the critical path) and ``prefetched`` (paged ahead), per step summed over layers;
- ``sweep``: K/E = the first ``--kfrac``, batch 1, prefetch true, for each grid size of the
  side-stream prefetch gather grid's cap (``CudaStore(background=GatherGrid(cap=N))``) in ``--sweep``.

Derived, per paged row: misses and speed-up against the same K/E and batch with prefetch off
(goals at K/E = 0.25: misses x <= 0.5, speed-up >= 1.3); the physics bound, the unpaged step plus
the critical-path bytes (misses x expert bytes) at the pinned H2D memcpy rate measured in this run
(the best of copies of 1, 4 and 16 experts' bytes), and the same with every paged byte (misses +
prefetched); exactness: every repetition's logits (and, greedy, tokens) ``torch.equal`` the
unpaged run's. Recall one layer ahead is measured by hooks on the unpaged model's routers over the
same decode steps (eager): the share of layer T's routed experts in the top-m of layer T's router
applied to what layer T-1's experts received (the prefetch predictor), per token and per step
(the union over the batch, which is what a step prefetches).

Writes ``prefetch_bench.{json,md,png}`` under ``--out``; exits 1 if an output differed or a
configuration failed. Where ``moepage.wrap`` takes no ``prefetch`` argument yet, prefetch rows say
so and the rest runs.

    python -m bench.models.prefetch_bench [--ckpt /tmp/h200_moe] [--train-minutes 3] [--out /tmp/prefetch_bench]
    python -m bench.models.prefetch_bench --cpu-smoke --out DIR    # CPU: tests/data/tiny_moe, eager, torch backend

On a machine without CUDA it skips (exit 0) unless ``--cpu-smoke``: the same code on the committed
tiny checkpoint, fp32, ``backend="torch", device_planner=True``, steps run eagerly inside
``moepage.capture_mode()`` (the path a capture takes), a few tokens: the logic, not the speed.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import inspect
import json
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

import moepage
from bench import common
from bench.analysis.routing_analysis import overlap, router_topk
from bench.common import Goal, bound_ms, capture, guarded, memcpy_gbs, num, table, versions
from bench.models import train_moe as tm
from moepage.integrations.transformers.decode import StaticDecode

ROOT = Path(__file__).resolve().parents[2]

DEFAULT_CKPT = Path("/tmp/h200_moe")
TINY = ROOT / "tests" / "data" / "tiny_moe"
GOAL_KFRAC = 0.25
GOAL_MISSES = Goal("<=", 0.5, "critical-path misses x{value} of off (goal {op} {limit}): {verdict}")
GOAL_SPEEDUP = Goal(">=", 1.3, "speed-up x{value} over off (goal {op} {limit}): {verdict}")
SMOKE_LINK_GBS = 50.0  # no link on CPU: an assumed rate, so the bound's arithmetic runs


def log(msg: str) -> None:
    print(msg, flush=True)


@dataclass
class Setup:
    device: torch.device
    graph: bool  # capture the decode step (CUDA) or run it eagerly inside capture_mode (CPU)
    backend: str
    prompt: int
    steps: int
    reps: int
    warmup: int
    teacher: bool
    wrap_kwargs: dict = field(default_factory=dict)


# -- configuration (pure Python) ---------------------------------------------------------------------
def prefetch_values(spec: str, top_k: int) -> list:
    """``--prefetch`` as ``wrap``'s values: off -> False, true -> True, Nk -> N * top_k, N -> N."""
    out = []
    for tok in (t.strip().lower() for t in spec.split(",") if t.strip()):
        if tok in ("off", "false", "0"):
            out.append(False)
        elif tok in ("on", "true"):
            out.append(True)
        elif tok.endswith("k"):
            out.append(int(tok[:-1] or 1) * top_k)
        else:
            out.append(int(tok))
    return out


def label(prefetch) -> str:
    return "off" if prefetch is False else "router top-k" if prefetch is True else f"router top-{prefetch}"


def wrap_takes_prefetch() -> bool:
    return "prefetch" in inspect.signature(moepage.wrap).parameters


def derive(rows: list[dict], unpaged: dict, expert_bytes: int, link_gbs: float) -> None:
    """Ratios against prefetch off (same batch and K), bounds and tokens/s, in place."""
    for r in rows:
        if r.get("ms") is None:
            continue
        b = r["batch"]
        r["tok_s"] = b * 1e3 / r["ms"]
        if b in unpaged:
            r["vs_unpaged"] = unpaged[b] / r["ms"]
        if r["run"] not in ("moepage", "sweep") or r.get("misses_step") is None:
            continue
        off = next((o for o in rows if o["run"] == "moepage" and o["batch"] == b and o["k"] == r["k"]
                    and o["prefetch"] == "off" and o.get("ms") is not None), None)
        if off is not None and r["prefetch"] != "off":
            r["speedup_vs_off"] = off["ms"] / r["ms"]
            r["misses_vs_off"] = r["misses_step"] / off["misses_step"] if off["misses_step"] else None
        if b in unpaged:
            r["bound_ms"] = bound_ms(unpaged[b], r["misses_step"] * expert_bytes, link_gbs)
            r["bound_all_ms"] = bound_ms(unpaged[b],
                                         (r["misses_step"] + (r.get("prefetched_step") or 0)) * expert_bytes,
                                         link_gbs)
            r["vs_bound"] = r["ms"] / r["bound_ms"]


def goals(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["run"] != "moepage" or r["prefetch"] == "off" or abs((r["k_over_e"] or 0) - GOAL_KFRAC) > 1e-6:
            continue
        where = f"B={r['batch']} K/E={r['k_over_e']:.2f} prefetch {r['prefetch']}"
        if r.get("ms") is None:
            out.append(f"- {where}: no figure ({r['mode']})")
            continue
        out += [GOAL_MISSES.line(where, r.get("misses_vs_off")), GOAL_SPEEDUP.line(where, r.get("speedup_vs_off"))]
    return out or ["- no prefetch row at K/E = 0.25 ran"]


def markdown(rows: list[dict]) -> str:
    return table([{
        "B": r["batch"], "run": r["run"], "K/E": num(r.get("k_over_e"), ".2f"), "K": r.get("k") or "-",
        "prefetch": r.get("prefetch") or "-", "programs": r.get("programs") or "-", "mode": r["mode"],
        "ms/step": num(r.get("ms")), "tok/s": num(r.get("tok_s"), ".1f"), "x unpaged": num(r.get("vs_unpaged")),
        "misses/step": num(r.get("misses_step"), ".2f"), "misses/token": num(r.get("misses_token"), ".2f"),
        "prefetched/step": num(r.get("prefetched_step"), ".2f"), "misses x off": num(r.get("misses_vs_off")),
        "speed-up x off": num(r.get("speedup_vs_off")),
        "recall token / step": f"{num(r.get('recall_token'))} / {num(r.get('recall_step'))}",
        "bound ms (crit / all)": f"{num(r.get('bound_ms'))} / {num(r.get('bound_all_ms'))}",
        "x bound": num(r.get("vs_bound")), "equal": {True: "yes", False: "NO", None: "-"}[r.get("equal")],
    } for r in rows])


# -- model, data, link -------------------------------------------------------------------------------
def load(path: Path, device: torch.device, dtype: torch.dtype, experts: str, attn: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    cfg._experts_implementation = experts
    model = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=dtype, attn_implementation=attn)
    if device.type == "cpu":
        for p in model.parameters():  # owned, aligned storage, as moepage's slots are (CPU fp32 exactness)
            p.data = p.data.clone()
    return model.to(device).eval().requires_grad_(False)


def held_out(count: int, length: int) -> torch.Tensor:
    """``count`` evenly spaced windows of ``length`` tokens of the val split."""
    return tm.val_windows(tm.corpus("val"), length - 1, count)


def expert_bytes(model) -> int:
    """Bytes of one expert's rows (every parameter of the experts module with a leading E)."""
    _, experts = moepage.find_experts(model)[0]
    e = model.config.num_experts
    return sum(p[0].numel() * p.element_size() for p in experts.parameters(recurse=False)
               if p.dim() and p.shape[0] == e)


def link_rates(nbytes: int) -> dict[str, float]:
    """GB/s of a pinned H2D cudaMemcpyAsync of 1, 4 and 16 experts' bytes."""
    return {f"{n} x expert": memcpy_gbs(n * nbytes) for n in (1, 4, 16)}


# -- decode ------------------------------------------------------------------------------------------
class Decoder:
    """One model's decode of one batch of held-out windows: ``prepare`` (prefill, eager), then
    ``steps`` (timed), with every step's logits kept in ``logits [steps, B, V]`` and its input
    token in ``inputs [steps, B, 1]``; on CUDA the step is one captured graph."""

    def __init__(self, model, windows: torch.Tensor, setup: Setup):
        self.s = setup
        b = windows.shape[0]
        self.dec = StaticDecode(model, windows[:, : setup.prompt].tolist(), setup.steps)
        text = windows[:, setup.prompt : setup.prompt + setup.steps].T.reshape(setup.steps, b, 1)
        self.text = text.to(setup.device)
        self.logits = torch.zeros(setup.steps, b, model.config.vocab_size, device=setup.device)
        self.inputs = torch.zeros(setup.steps, b, 1, dtype=torch.long, device=setup.device)
        self.graph = self.out = None
        self.first = None
        if setup.graph:
            self.prepare()
            self.dec.feed(0, self.first)
            self.graph, self.out = capture(self.dec.step, n=1, warmup=2)

    def prepare(self) -> None:
        logits = self.dec.prefill()
        self.first = self.text[0] if self.s.teacher else logits.argmax(-1, keepdim=True)

    def _step(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
            return self.out
        with moepage.capture_mode():  # the path a capture takes
            return self.dec.step()

    def steps(self) -> float:
        """The decode steps after ``prepare``; returns their milliseconds."""
        cuda = self.s.device.type == "cuda"
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        token = self.first
        for i in range(self.s.steps):
            self.dec.feed(i, token)
            self.inputs[i].copy_(token)
            out = self._step()
            self.logits[i].copy_(out)
            if i + 1 < self.s.steps:
                token = self.text[i + 1] if self.s.teacher else out.argmax(-1, keepdim=True)
        if cuda:
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        return (time.perf_counter() - t0) * 1e3


def counters(model) -> dict:
    t = moepage.stats(model).total
    return dict(misses=t.misses, hits=t.hits, steps=t.steps, waves=t.waves, prefetched=getattr(t, "prefetched", None))


@torch.no_grad()
def measure(model, windows: torch.Tensor, setup: Setup, ref: dict | None, paged: bool) -> tuple[dict, dict]:
    """Warm-up and timed repetitions of one model at one batch; returns the row's figures and the
    outputs (the first repetition's; with ``ref``, each repetition is compared to it)."""
    dec = Decoder(model, windows, setup)
    b, n = windows.shape[0], setup.steps
    times, deltas, equal = [], [], True
    first = None
    for rep in range(setup.warmup + setup.reps):
        dec.prepare()
        before = counters(model) if paged else None
        ms = dec.steps()
        after = counters(model) if paged else None
        outs = dict(logits=dec.logits, inputs=dec.inputs)
        want = ref if ref is not None else first
        if want is not None:
            equal &= torch.equal(outs["logits"], want["logits"]) and torch.equal(outs["inputs"], want["inputs"])
        if first is None:
            first = {k: v.clone() for k, v in outs.items()}
        if rep >= setup.warmup:
            times.append(ms)
            if paged:
                deltas.append({k: None if after[k] is None else after[k] - before[k] for k in after})
    res = dict(mode="graph" if setup.graph else "eager (capture_mode)", ms=statistics.median(times) / n,
               ms_reps=[t / n for t in times], steps=n, reps=setup.reps, equal=bool(equal))
    if paged:
        mean = lambda key: None if deltas[0][key] is None else float(np.mean([d[key] for d in deltas])) / n  # noqa: E731
        res.update(misses_step=mean("misses"), hits_step=mean("hits"), prefetched_step=mean("prefetched"),
                   waves_step=mean("waves"), layer_steps_step=mean("steps"))
        res["misses_token"] = res["misses_step"] / b
    del dec
    return res, first


@torch.no_grad()
def recall(model, windows: torch.Tensor, setup: Setup, sizes: list[int]) -> dict:
    """Recall one layer ahead over the decode steps (eager, hooks on every router): for each m in
    ``sizes``, per token (|top-m ∩ routed| / top_k) and per step (the union over the batch of the
    predictions against the step's distinct routed experts), per target layer and mean."""
    layers = model.model.layers
    b = windows.shape[0]
    seen: dict[int, list] = {i: [] for i in range(len(layers))}

    def hook(i):
        def fn(module, args, output):
            if args[0].shape[0] == b:  # decode steps only: the prefill has B x prompt tokens
                seen[i].append((args[0].detach().clone(), output[2].detach().clone()))
        return fn

    handles = [layer.mlp.gate.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        dec = Decoder(model, windows, replace(setup, graph=False))
        dec.prepare()
        dec.steps()
    finally:
        for h in handles:
            h.remove()
    out = {}
    for m in sizes:
        per_layer = []
        for t in range(1, len(layers)):
            x = torch.cat([a for a, _ in seen[t - 1]])  # what layer t-1's experts received, [S * B, H]
            actual = torch.cat([ids for _, ids in seen[t]]).cpu().numpy()  # [S * B, top_k]
            pred = router_topk(layers[t], x, m).cpu().numpy()
            k, s = actual.shape[1], actual.shape[0] // b
            step_recall, predicted, routed = [], [], []
            for p_s, a_s in zip(pred.reshape(s, -1), actual.reshape(s, -1)):
                want, got = set(a_s.tolist()), set(p_s.tolist())
                step_recall.append(len(want & got) / len(want))
                predicted.append(len(got))
                routed.append(len(want))
            per_layer.append(dict(target=t, token=float(overlap(pred, actual).mean()), step=float(np.mean(step_recall)),
                                  predicted_experts=float(np.mean(predicted)), routed_experts=float(np.mean(routed)),
                                  top_k=k))
        out[m] = dict(m=m, batch=b, token=float(np.mean([p["token"] for p in per_layer])),
                      step=float(np.mean([p["step"] for p in per_layer])),
                      predicted_experts=float(np.mean([p["predicted_experts"] for p in per_layer])),
                      routed_experts=float(np.mean([p["routed_experts"] for p in per_layer])), layers=per_layer)
    return out


# -- the run -----------------------------------------------------------------------------------------
class Bench:
    def __init__(self, model, windows: dict[int, torch.Tensor], setup: Setup, rows: list[dict]):
        self.model, self.windows, self.s, self.rows = model, windows, setup, rows
        self.e, self.top_k = model.config.num_experts, model.config.num_experts_per_tok
        self.refs: dict[int, dict] = {}
        self.unpaged_ms: dict[int, float] = {}
        self.errors: list[str] = []

    def add(self, run: str, b: int, k: int | None = None, prefetch=None, **res) -> dict:
        row = dict(run=run, batch=b, k_over_e=None if k is None else k / self.e, k=k,
                   prefetch=None if prefetch is None else label(prefetch), **res)
        self.rows.append(row)
        return row

    def unpaged(self, run: str = "unpaged") -> None:
        for b, w in self.windows.items():
            t0 = time.perf_counter()
            got = guarded(self.errors, f"{run} B={b}", measure, self.model, w, self.s, self.refs.get(b), False)
            if got is None:
                continue
            res, outs = got
            if b not in self.refs:
                self.refs[b], self.unpaged_ms[b] = outs, res["ms"]
                if not res["equal"]:
                    log(f"  {run} B={b}: repetitions differ from each other: "
                        "the exactness check has no stable reference")
            self.add(run, b, **res)
            log(f"  {run} B={b}: {res['ms']:.3f} ms/step ({res['mode']}), {b * 1e3 / res['ms']:.1f} tok/s, "
                f"reproducible/equal {res['equal']} [{time.perf_counter() - t0:.1f} s]")

    def paged_copy(self, k: int, prefetch, store=None):

        model = copy.deepcopy(self.model)
        kwargs = dict(self.s.wrap_kwargs)
        if prefetch is not False:
            kwargs["prefetch"] = prefetch
        try:
            return moepage.wrap(model, resident=k, backend=store or self.s.backend, **kwargs)
        except BaseException:
            del model
            raise

    @staticmethod
    def release(model) -> None:
        stores = {id(layer.store): layer.store for layer in moepage.paged_layers(model)}
        for store in stores.values():
            store.close()
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def paged(self, k: int, prefetch, batches, run: str = "moepage", store=None, **extra) -> None:
        t0 = time.perf_counter()
        model = guarded(self.errors, f"wrap K={k} prefetch {label(prefetch)}", self.paged_copy, k, prefetch, store)
        if model is None:
            for b in batches:
                self.add(run, b, k, prefetch, mode="wrap failed", **extra)
            return
        log(f"  K={k} prefetch {label(prefetch)}{''.join(f' {a}={v}' for a, v in extra.items())}: "
            f"wrapped in {time.perf_counter() - t0:.1f} s")
        try:
            for b in batches:
                t1 = time.perf_counter()
                got = guarded(self.errors, f"{run} B={b} K={k} prefetch {label(prefetch)}", measure, model,
                              self.windows[b], self.s, self.refs.get(b), True)
                if got is None:
                    self.add(run, b, k, prefetch, mode="failed", **extra)
                    continue
                res = got[0]
                if b not in self.refs:
                    res["equal"] = None
                self.add(run, b, k, prefetch, **res, **extra)
                pf = res.get("prefetched_step")
                log(f"    B={b}: {res['ms']:.3f} ms/step, misses/step {res['misses_step']:.2f}, prefetched/step "
                    f"{num(pf, '.2f')}, equal {res['equal']} [{time.perf_counter() - t1:.1f} s]")
        finally:
            self.release(model)


def run(args, setup: Setup, model, rows: list[dict], meta: dict) -> list[str]:
    top_k, e = model.config.num_experts_per_tok, model.config.num_experts
    prefetches = prefetch_values(args.prefetch, top_k)
    length = setup.prompt + setup.steps
    texts = held_out(max(args.batch), length)
    windows = {b: texts[:b] for b in args.batch}
    bench = Bench(model, windows, setup, rows)
    eb = expert_bytes(model)
    meta.update(expert_bytes=eb, num_experts=e, top_k=top_k, layers=model.config.num_hidden_layers)

    t0 = time.perf_counter()
    if setup.device.type == "cuda":
        meta["link_gbs"] = link_rates(eb)
        link = max(meta["link_gbs"].values())
    else:
        meta["link_gbs"], link = {"assumed (CPU smoke)": SMOKE_LINK_GBS}, SMOKE_LINK_GBS
    log(f"expert {eb / 1e6:.2f} MB; pinned H2D memcpy GB/s: "
        + ", ".join(f"{k} {v:.1f}" for k, v in meta["link_gbs"].items()) + f" [{time.perf_counter() - t0:.1f} s]")

    meta["recall"] = _recalls(bench, model, windows, setup, prefetches, top_k)

    log("unpaged:")
    bench.unpaged()
    takes = wrap_takes_prefetch()
    meta["wrap_takes_prefetch"] = takes
    for kfrac in args.kfrac:
        k = int(kfrac * e + 0.5)
        for p in prefetches:
            if p is not False and not takes:
                for b in args.batch:
                    bench.add("moepage", b, k, p, mode="n/a: moepage.wrap takes no prefetch argument")
                continue
            bench.paged(k, p, args.batch)

    _sweep(args, bench, int(args.kfrac[0] * e + 0.5), takes, meta)

    log("unpaged again:")
    bench.unpaged("unpaged again")
    for r in rows:  # the recall of each prefetch row's predictor, at its batch
        if r.get("prefetch") not in (None, "off"):
            m = top_k if r["prefetch"] == "router top-k" else int(r["prefetch"].rsplit("-", 1)[1])
            rec = (meta["recall"].get(r["batch"]) or {}).get(m)
            if rec:
                r["recall_token"], r["recall_step"] = rec["token"], rec["step"]
    derive(rows, bench.unpaged_ms, eb, link)
    return bench.errors


def _recalls(bench: Bench, model, windows: dict, setup: Setup, prefetches, top_k: int) -> dict:
    """The router's recall one layer ahead per batch and predictor size, logged."""
    t0 = time.perf_counter()
    sizes = sorted({p if p is not True else top_k for p in prefetches if p is not False} | {top_k, 2 * top_k})
    found = {b: guarded(bench.errors, f"recall B={b}", recall, model, w, setup, sizes) for b, w in windows.items()}
    for b, rec in found.items():
        if rec:
            log(f"recall one layer ahead, B={b}: " + "; ".join(
                f"top-{m}: token {r['token']:.3f}, step {r['step']:.3f} ({r['predicted_experts']:.1f} predicted vs "
                f"{r['routed_experts']:.1f} routed experts per layer)" for m, r in rec.items()))
    log(f"[recall: {time.perf_counter() - t0:.1f} s]")
    return found


def _sweep(args, bench: Bench, k: int, takes: bool, meta: dict) -> None:
    """The background gather grid's cap swept at K = ``k``, the smallest batch, prefetch on (``--sweep``)."""
    b = min(args.batch)
    if args.sweep and not takes:
        bench.add("sweep", b, k, True, mode="n/a: moepage.wrap takes no prefetch argument")
    elif args.sweep and args.cpu_smoke:
        bench.add("sweep", b, k, True, mode="n/a: the background grid is the cuda backend's")
    elif args.sweep:
        from moepage.backends.cuda import CudaStore
        from moepage.kernels.gather import BACKGROUND, GatherGrid

        meta["background_programs_default"] = BACKGROUND.cap
        log(f"sweep of the background gather grid's cap (default {BACKGROUND.cap}) at K={k}, B={b}, prefetch true:")
        for programs in args.sweep:
            bench.paged(k, True, [b], run="sweep", store=CudaStore(background=GatherGrid(cap=programs)),
                        programs=programs)


def plot(rows: list[dict], path: Path, title: str) -> None:
    batches = sorted({r["batch"] for r in rows if r["run"] == "moepage"})
    sweep = [r for r in rows if r["run"] == "sweep" and r.get("tok_s")]
    fig, axes = common.figure(max(len(batches) + (1 if sweep else 0), 1), (5, 3.8))
    for ax, b in zip(axes, batches):
        rs = [r for r in rows if r["run"] == "moepage" and r["batch"] == b]
        kfracs = sorted({r["k_over_e"] for r in rs})
        labels = list(dict.fromkeys(r["prefetch"] for r in rs))
        cells = [[next((r for r in rs if r["k_over_e"] == kf and r["prefetch"] == lab), {}) for kf in kfracs]
                 for lab in labels]
        xss = common.bars(ax, [(f"prefetch {lab}", [c.get("tok_s") or 0 for c in cell])
                               for lab, cell in zip(labels, cells)])
        for j, (xs, cell) in enumerate(zip(xss, cells)):
            bx = [(x, b * 1e3 / c["bound_ms"]) for x, c in zip(xs, cell) if c.get("bound_ms")]
            if bx:
                ax.plot(*zip(*bx), "k_", markersize=14, label="bound (critical bytes)" if j == 0 else None)
        un = next((r for r in rows if r["run"] == "unpaged" and r["batch"] == b and r.get("tok_s")), None)
        if un:
            ax.axhline(un["tok_s"], color="g", ls="--", label="unpaged")
        ax.set(title=f"batch {b}", xticks=range(len(kfracs)), xticklabels=[f"K/E {kf:.2f}" for kf in kfracs],
               ylabel="decode tokens/s")
        ax.legend(fontsize=7)
    if sweep:
        ax = axes[len(batches)]
        pts = sorted((r["programs"], r["tok_s"]) for r in sweep)
        ax.plot(*zip(*pts), "o-")
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set(title=f"prefetch gather grid (K/E {sweep[0]['k_over_e']:.2f}, B={sweep[0]['batch']}, router top-k)",
               xlabel="background gather programs (cap)", ylabel="decode tokens/s", xticks=[p for p, _ in pts],
               xticklabels=[str(p) for p, _ in pts])
    common.save(fig, path, title)


def report(rows: list[dict], meta: dict, errors: list[str], out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    measured = [r for r in rows if r.get("equal") is not None]
    exact = bool(measured) and all(r["equal"] for r in measured) and not errors
    verdicts = goals(rows)
    meta["exactness"] = "PASS" if exact else "FAIL"
    recall_lines = []
    for b, rec in (meta.get("recall") or {}).items():
        for m, r in (rec or {}).items():
            recall_lines.append(f"| {b} | top-{m} | {r['token']:.3f} | {r['step']:.3f} | "
                                f"{r['predicted_experts']:.1f} | {r['routed_experts']:.1f} | "
                                + " ".join(f"{p['token']:.2f}" for p in r["layers"]) + " |")
    md = "\n".join([
        meta["note"], "",
        markdown(rows), "",
        "Recall one layer ahead (layer T's router, top-m, on what layer T-1's experts received; token: per token; "
        "step: the batch's union against the step's routed experts; per target layer 1..L-1):", "",
        "| B | predicted | token | step | predicted experts / layer | routed experts / layer | per layer (token) |",
        "|---|---|---|---|---|---|---|", *recall_lines, "",
        f"Exactness (every repetition's logits torch.equal the unpaged run's, {len(measured)} rows): "
        f"{meta['exactness']}", "",
        "Goals (K/E = 0.25):", *verdicts, *[f"- ERROR {e}" for e in errors],
    ])
    (out / "prefetch_bench.md").write_text(md + "\n")
    common.write_json(out / "prefetch_bench.json", dict(meta=meta, rows=rows, goals=verdicts, errors=errors))
    if rows:
        try:
            plot(rows, out / "prefetch_bench.png", meta["title"])
        except ImportError as exc:
            log(f"no plot: {exc}")
    return md


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", type=Path,
                    help=f"trained checkpoint (default {DEFAULT_CKPT}; --cpu-smoke: {TINY.relative_to(ROOT)})")
    ap.add_argument("--train-minutes", type=float,
                    help="if --ckpt is missing, train the h200 preset there for this long first")
    ap.add_argument("--out", type=Path, default=Path("/tmp/prefetch_bench"))
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--kfrac", default="0.25,0.5", help="K / E values")
    ap.add_argument("--prefetch", default="off,true,2k", help="off, true (router top-k), Nk (top-N*k), N (top-N)")
    ap.add_argument("--sweep", default="8,16,32,64", help="background gather grid caps ('' to skip)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt bytes (held-out text)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per repetition")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    ap.add_argument("--mode", choices=("teacher", "greedy"), default="teacher",
                    help="teacher: feed the held-out text (every configuration runs the same steps); "
                         "greedy: the argmax")
    ap.add_argument("--attn", default="eager", help="attention implementation (eager: no value-dependent mask path)")
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU: tiny checkpoint, eager, torch backend, few tokens")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (--cpu-smoke)")
    args = ap.parse_args(argv)
    args.batch = [int(x) for x in args.batch.split(",") if x.strip()]
    args.kfrac = [float(x) for x in args.kfrac.split(",") if x.strip()]
    args.sweep = [int(x) for x in args.sweep.split(",") if x.strip()]
    if args.prompt < 2:
        ap.error("--prompt must be at least 2 (the recall hooks tell the prefill from decode steps by token count)")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    started = time.perf_counter()
    if args.cpu_smoke:
        torch.set_num_threads(args.threads)
        ckpt = args.ckpt or TINY
        setup = Setup(torch.device("cpu"), graph=False, backend="torch", prompt=min(args.prompt, 16),
                      steps=min(args.steps, 6), reps=min(args.reps, 1), warmup=min(args.warmup, 1),
                      teacher=args.mode == "teacher", wrap_kwargs=dict(device_planner=True))
        dtype, experts = torch.float32, "batched_mm"
    elif not any(True for _ in importlib.metadata.entry_points(group="moepage.runners")):
        log("prefetch_bench: moepage's entry points are not visible (not installed): HF experts would get the "
            "generic runner, which is not bit-exact on CUDA. pip install -e . (or bash bench/gpu_sglang_lease.sh ep "
            "and PYTHONPATH=$PWD:/tmp/moepage_ep)")
        return 2
    elif not torch.cuda.is_available():
        log("prefetch_bench: skipped: no CUDA device here "
            "(--cpu-smoke runs the same logic on CPU on tests/data/tiny_moe)")
        return 0
    else:
        ckpt = args.ckpt or DEFAULT_CKPT
        setup = Setup(torch.device("cuda"), graph=True, backend="cuda", prompt=args.prompt, steps=args.steps,
                      reps=args.reps, warmup=args.warmup, teacher=args.mode == "teacher")
        dtype, experts = torch.bfloat16, "grouped_mm"
    if not (ckpt / "config.json").is_file():
        if args.train_minutes and not args.cpu_smoke:
            log(f"{ckpt}: no checkpoint; training the h200 preset for {args.train_minutes} min")
            tm.train("h200", ckpt, minutes=args.train_minutes)
            gc.collect()
            torch.cuda.empty_cache()  # the trainer's masters and AdamW state
        else:
            log(f"prefetch_bench: no checkpoint at {ckpt} (train one: --train-minutes 3, or "
                f"python -m bench.models.train_moe --preset h200 --out {ckpt} --minutes 3)")
            return 2
    t0 = time.perf_counter()
    with torch.no_grad():
        model = load(ckpt, setup.device, dtype, experts, args.attn)
    device = f"CPU smoke ({versions()})" if args.cpu_smoke else versions()
    log(f"{device}; {ckpt}: loaded in {time.perf_counter() - t0:.1f} s")
    trained = {}
    if (ckpt / "loss.json").is_file():
        loss = json.loads((ckpt / "loss.json").read_text())
        trained = {k: loss.get(k) for k in ("preset", "steps", "seconds", "tokens", "val_saved", "device", "torch")}
    note = (f"prefetch_bench on {device}: {ckpt.name} (trained: {trained or 'no loss.json'}); "
            f"{'teacher-forced held-out text' if setup.teacher else 'greedy'}, "
            f"prompt {setup.prompt} bytes, {setup.steps} decode steps x {setup.reps} timed repetitions (median) after "
            f"{setup.warmup}; {'one CUDA graph per step' if setup.graph else 'eager steps inside capture_mode'}; "
            f"backend {setup.backend}; experts {experts}; attention {args.attn}; {dtype}")
    title = (f"{ckpt.name}: {'teacher-forced' if setup.teacher else 'greedy'} decode, "
             f"{'CUDA graphs' if setup.graph else 'eager (CPU smoke)'}; {device}")
    meta = dict(note=note, title=title, checkpoint=str(ckpt), trained=trained,
                setup={k: str(v) for k, v in vars(setup).items()}, args={k: str(v) for k, v in vars(args).items()})
    rows: list[dict] = []
    try:
        errors = run(args, setup, model, rows, meta)
    except Exception as exc:  # noqa: BLE001 - write what was measured
        import traceback

        traceback.print_exc()
        errors = [f"{type(exc).__name__}: {exc}"]
    meta["seconds"] = time.perf_counter() - started
    md = report(rows, meta, errors, args.out)
    log("\n" + md)
    log(f"exactness: {meta['exactness']}; {time.perf_counter() - started:.1f} s in all; "
        f"wrote {args.out}/prefetch_bench.{{json,md,png}}")
    return 0 if meta["exactness"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
