"""Eviction policies and per-layer budgets on every real trace in ../shared/data/traces and on the
Qwen3-30B-A3B-calibrated synthetic routing, at K/E in {0.25, 0.5, 0.75} (issue 14). CPU only.

    python -m bench.analysis.trace_replay [--tokens 2000] [--md OUT.md] [--png OUT.png] [--jobs N]

1. Policy evidence: misses per step (summed over layers) of lru, lfu, lfru and Belady's bound on
   the real traces, the synthetic sets (locality rho = 0, 0.3, 0.6; batch 1 and 8) and uniform
   routing (5 seeds), and the rule that picks the default: a frequency-aware policy becomes the
   default if it is never worse than LRU by more than the noise bound (the largest |difference|
   from LRU, in %, over the uniform seeds, where no policy can do better than chance) and better
   by over 5 % at a third of the other points or more; of those that pass, the one with the
   largest mean reduction.
2. Budgets: misses per step of LRU (uniform K), the default policy (uniform K), the default with
   per-layer budgets (the same total slots, ``moepage.budgets``) and Belady. A synthetic set's split
   comes from a second trace of the same generator with another seed (held out); a real trace's
   split from the trace itself (in-sample), and a held-out check splits on the first half of the
   trace and replays the second half.

Replays run in ``--jobs`` processes (default: one per CPU); each builds the traces it needs once.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench import common
from bench.common import Goal, table
from bench.data import traces as real
from moepage.planning import budgets, synthetic, traces
from moepage.residency import DEFAULT_POLICY

FRACTIONS = ("0.25", "0.5", "0.75")
POLICIES = ("lru", "lfu", "lfru", "belady")
FREQUENCY = ("lfu", "lfru")
MUCH_BETTER = 5.0  # % fewer misses than LRU that counts as "much better"
CALIB_SEED = 100  # synthetic budgets are split on this seed's trace, measured on seed 0's
BUDGETS = Goal("<=", -15, "default + budgets {value} % vs LRU (goal {op} {limit} %: {verdict})", fmt="+.1f")


# -- workloads: hashable keys, built (once per process) by make_trace ------------------------------
def real_keys() -> list[tuple]:
    return [("real", spec) for spec in real.REAL]


def qwen_keys(tokens: int, seed: int = 0) -> list[tuple]:
    return [("qwen", rho, batch, seed, tokens if batch == 1 else tokens // 4)
            for batch in (1, 8) for rho in (0.0, 0.3, 0.6)]


def uniform_keys(tokens: int) -> list[tuple]:
    return [("uniform", seed, tokens) for seed in range(5)]


@functools.lru_cache(maxsize=4)
def make_trace(key: tuple) -> traces.Trace:
    kind = key[0]
    if kind == "real":
        return real.load(key[1])
    if kind == "half":  # ("half", spec, 0 | 1): first or second half of a real trace
        full = make_trace(("real", key[1]))
        mid = full.num_steps // 2
        return full.window(0, mid) if key[2] == 0 else full.window(mid, full.num_steps)
    if kind == "qwen":
        _, rho, batch, seed, steps = key
        name = (f"qwen3-30b synthetic rho={rho:g}" + (f" batch={batch}" if batch > 1 else "")
                + (f" seed={seed}" if seed else ""))
        return synthetic.synthetic_trace(synthetic.calibrated(rho, seed=seed), steps, batch=batch, name=name)
    _, seed, steps = key
    return synthetic.synthetic_trace(synthetic.uniform(48, 128, 8, 0.0, seed=seed), steps,
                                     name=f"uniform 48x128 top-8 seed={seed}")


INFO: dict[tuple, tuple] = {}  # key -> (name, E, top_k, layers, steps), filled by the parent from workers


def label(key: tuple) -> str:
    return INFO[key][0]


# -- tasks (run in workers) ----------------------------------------------------------------------
def task_info(key: tuple) -> tuple:
    t = make_trace(key)
    return key, (t.name, t.num_experts, t.top_k, len(t.layers), t.num_steps)


def task_replay(key: tuple, frac: str, policy: str) -> tuple:
    t = make_trace(key)
    k = traces.resolve_k(frac, t.num_experts)
    r = traces.replay(t, k, policy)
    return (key, frac, policy), (r.misses, t.num_steps, k, t.num_experts, t.top_k, len(t.layers))


def task_curve_point(key: tuple, k: int) -> tuple:
    return (key, k), traces.replay(make_trace(key), k, DEFAULT_POLICY).layer_misses


def task_split_replay(key: tuple, frac: str, ks: tuple) -> tuple:
    return (key, frac), budgets.replay_split(make_trace(key), list(ks), DEFAULT_POLICY)


def run_all(pool: ProcessPoolExecutor, calls: list[tuple]) -> dict:
    futures = [pool.submit(*c) for c in calls]
    return dict(f.result() for f in futures)


def pct(new: float, old: float) -> float:
    return 100.0 * (new - old) / old if old else 0.0


# -- 1. policy evidence --------------------------------------------------------------------------
def evidence(rows: dict, keys: list[tuple]) -> tuple[str, dict]:
    out = []
    deltas: dict[str, list[tuple[tuple, str, float]]] = {p: [] for p in FREQUENCY}
    for key in keys:
        for frac in FRACTIONS:
            got = {p: rows.get((key, frac, p)) for p in POLICIES}
            if any(v is None for v in got.values()):
                continue  # K below top_k
            misses, steps, k, e, top_k, layers = got["lru"]
            per = {p: got[p][0] / steps for p in POLICIES}
            for p in FREQUENCY:
                deltas[p].append((key, frac, pct(per[p], per["lru"])))
            out.append({"trace": label(key), "E": e, "top_k": top_k, "layers": layers, "steps": steps, "K": k,
                        "K/E": f"{k / e:.2f}", **{p: f"{per[p]:.2f}" for p in POLICIES},
                        **{f"{p} vs lru": f"{pct(per[p], per['lru']):+.1f} %" for p in FREQUENCY}})
    return table(out), deltas


def verdict(deltas: dict) -> tuple[list[str], str]:
    noise = max(abs(d) for p in FREQUENCY for key, _, d in deltas[p] if key[0] == "uniform")
    out = [f"Noise bound: {noise:.2f} % (the largest |difference from LRU| of lfu or lfru over the uniform seeds)."]
    passing = []
    for p in FREQUENCY:
        skewed = [(key, f, d) for key, f, d in deltas[p] if key[0] != "uniform"]
        worst = max(d for _, _, d in deltas[p])
        worse = [f"{label(key)} K/E={f} ({d:+.2f} %)" for key, f, d in deltas[p] if d > noise]
        better = sum(d < -MUCH_BETTER for _, _, d in skewed)
        mean = sum(d for _, _, d in skewed) / len(skewed)
        ok = not worse and better * 3 >= len(skewed)
        out.append(f"- {p}: worst {worst:+.2f} % vs LRU; worse than LRU beyond noise at {len(worse)} points {worse}; "
                   f"better by over {MUCH_BETTER:g} % at {better}/{len(skewed)} non-uniform points; "
                   f"mean {mean:+.1f} % -> {'passes' if ok else 'fails'} the rule")
        if ok:
            passing.append((mean, p))
    chosen = min(passing)[1] if passing else "lru"
    out.append(f"Default by the rule: {chosen} (residency.DEFAULT_POLICY = {DEFAULT_POLICY!r}"
               f"{'' if chosen == DEFAULT_POLICY else ': DISAGREES, update it'}).")
    return out, chosen


# -- 2. budgets ----------------------------------------------------------------------------------
def budget_table(pool: ProcessPoolExecutor, rows: dict, evals: list[tuple], calib: dict) -> tuple[str, dict]:
    """Columns: LRU, default, default + budgets, Belady (misses per step) at each K/E."""
    ks_of = lambda key: range(INFO[key][2], INFO[key][1] + 1)  # top_k .. E
    calib_keys = sorted(set(calib[key] for key in evals))
    by_k = run_all(pool, [(task_curve_point, key, k) for key in calib_keys for k in ks_of(key)])
    splits = {}
    for key in evals:
        _, e, top_k, layers, _ = INFO[calib[key]]
        curves = [list(layer) for layer in zip(*(by_k[(calib[key], k)] for k in ks_of(calib[key])))]
        for frac in FRACTIONS:
            k = traces.resolve_k(frac, e)
            if k >= top_k:
                splits[(key, frac)] = budgets.allocate(curves, k * layers, top_k)
    measured = run_all(pool, [(task_split_replay, key, frac, tuple(ks)) for (key, frac), ks in splits.items()])
    out, summary = [], {}
    for key in evals:
        for frac in FRACTIONS:
            if (key, frac) not in splits:
                continue
            misses, steps, k, e, _, _ = rows[(key, frac, "lru")]
            lru, dflt, belady = (rows[(key, frac, p)][0] / steps for p in ("lru", DEFAULT_POLICY, "belady"))
            split = measured[(key, frac)] / steps
            source = "itself (in-sample)" if calib[key] == key else label(calib[key])
            summary[(key, frac)] = (lru, dflt, split, belady)
            out.append({"trace": label(key), "K/E": f"{k / e:.2f}", "K": k, "LRU": f"{lru:.2f}",
                        f"{DEFAULT_POLICY} (default)": f"{dflt:.2f}", f"{DEFAULT_POLICY} + budgets": f"{split:.2f}",
                        "Belady": f"{belady:.2f}", "default vs LRU": f"{pct(dflt, lru):+.1f} %",
                        "budgets vs LRU": f"{pct(split, lru):+.1f} %", "split from": source})
    return table(out), summary


def plot(summary: dict, png: str) -> None:
    keys = list(dict.fromkeys(key for key, _ in summary))
    fig, axes = common.figure(len(keys), (4.2, 3.4), cols=4)
    names = ("LRU", f"{DEFAULT_POLICY} (default)", f"{DEFAULT_POLICY} + budgets", "Belady")
    for ax, key in zip(axes, keys):
        pts = sorted((float(f), summary[(key, f)]) for k2, f in summary if k2 == key)
        for i, name in enumerate(names):
            ax.plot([x for x, _ in pts], [v[i] for _, v in pts], marker="o", label=name,
                    linestyle="--" if i == 3 else "-")
        ax.set_title(label(key), fontsize=9)
        ax.set(xlabel="K / E", ylabel="misses per step", ylim=(0, None))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    common.save(fig, png)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000, help="synthetic decode steps (batch 8: a quarter)")
    ap.add_argument("--md", help="also write the markdown tables here")
    ap.add_argument("--png", help="plot of misses per step against K/E (LRU, default, budgets, Belady)")
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (default: one per CPU)")
    args = ap.parse_args()
    t0 = time.time()
    reals, qwens, uniforms = real_keys(), qwen_keys(args.tokens), uniform_keys(args.tokens)
    halves = [("half", spec, h) for _, spec in reals for h in (0, 1)]
    calib = {key: key for key in reals}
    calib.update({q: c for q, c in zip(qwens, qwen_keys(args.tokens, CALIB_SEED))})
    calib.update({("half", spec, 1): ("half", spec, 0) for _, spec in reals})
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        INFO.update(run_all(pool, [(task_info, key)
                                   for key in reals + qwens + uniforms + halves + list(calib.values())]))
        rows = run_all(pool, [(task_replay, key, f, p)
                              for key in reals + qwens + uniforms for f in FRACTIONS for p in POLICIES]
                       + [(task_replay, key, f, p) for key in halves[1::2] for f in FRACTIONS for p in POLICIES])
        ev_table, deltas = evidence(rows, reals + qwens + uniforms)
        rule, chosen = verdict(deltas)
        bud_table, summary = budget_table(pool, rows, reals + qwens, calib)
        held_table, _ = budget_table(pool, rows, halves[1::2], calib)
    goals = []
    for key, name in ((qwens[1], "Qwen3 synthetic rho=0.3"), (reals[2], "FLAME-MoE")):
        lru, dflt, split, _ = summary[(key, "0.5")]
        goals.append(BUDGETS.line(f"{name}, K/E = 0.5", pct(split, lru)) + f"; default alone {pct(dflt, lru):+.1f} %.")
    worse = [(label(k), f, round(pct(v[1], v[0]), 2)) for (k, f), v in summary.items() if v[1] > v[0]]
    goals.append(f"- default vs LRU, uniform K, every trace of the table: more misses at {len(worse)} points {worse}.")
    text = "\n".join(["### Policy evidence (misses per step)", "", ev_table, "", *rule, "",
                      "### LRU, default, default with per-layer budgets, Belady (misses per step)", "", bud_table, "",
                      "Held-out check of the real traces' splits (split on the first half, replayed on the second):",
                      "", held_table, "", "Goals:", *goals, "", f"({time.time() - t0:.0f} s)"])
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    if args.png:
        plot(summary, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
