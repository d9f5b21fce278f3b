"""The ``moepage`` console script: ``trace`` (replay + plot), ``synth`` (write a synthetic trace),
``plan`` (choose K for a checkpoint and a GPU memory budget).

Parsing, printing and error reporting only; the work is in ``moepage.planning``. ``plan`` runs on a base install;
``trace`` and ``synth`` import numpy (``--png``: matplotlib) inside the command, naming the extra if one is missing.
Every error is one line on stderr naming the file or flag, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from . import __version__
from .errors import ConfigError
from .planning import policies, sizing
from .residency import DEFAULT_POLICY

if TYPE_CHECKING:
    from .planning.traces import ReplayResult

EXTRAS = {"numpy": "traces", "matplotlib": "bench"}  # optional dependency -> the extra installing it


def _optional(module: str, needed_by: str = ""):
    """Import ``module``; a missing optional dependency is a ``ConfigError`` naming its extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        dependency = (exc.name or "").partition(".")[0]
        if dependency not in EXTRAS:
            raise
        raise ConfigError(f'{needed_by}needs {dependency}: pip install "moepage[{EXTRAS[dependency]}]"') from None


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _typed(read: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse ``type`` from ``read``: its ValueError becomes argparse's error for the flag."""

    def convert(text: str) -> object:
        try:
            return read(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _number(kind: type, low: float, high: float = float("inf")) -> Callable[[str], object]:
    """An argparse ``type``: a ``kind`` (int or float) number in ``low..high``."""

    def read(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            what = "a whole number" if kind is int else "a number"
            bound = f"in {low:g}..{high:g}" if high != float("inf") else f">= {low:g}"
            raise ValueError(f"{text!r} is not {what} {bound}")
        return value

    return _typed(read)


def _ks(text: str, num_experts: int) -> list[int]:
    """``--k`` values for E experts, every one checked before anything is printed."""
    try:
        return [sizing.resolve_k(x, num_experts) for x in _csv(text)]
    except ValueError as exc:
        raise ConfigError(f"--k {text}: {exc}") from None


def format_table(results: Sequence[ReplayResult]) -> str:
    """One block per trace: rows K, columns policy: ``hit rate (misses per step)``."""
    lines: list[str] = []
    for name in dict.fromkeys(r.trace for r in results):
        rows = [r for r in results if r.trace == name]
        pols = list(dict.fromkeys(r.policy for r in rows))
        r0 = rows[0]
        lines.append(f"{name}: E={r0.num_experts}, {len(r0.layer_hits)} layers, {r0.steps} steps  "
                     "[hit rate (misses/step over all layers)]")
        lines.append(f"  {'K':>4} {'K/E':>5}  " + "  ".join(f"{p:>16}" for p in pols))
        for k in sorted({r.num_slots for r in rows}):
            by = {r.policy: r for r in rows if r.num_slots == k}
            cells = [f"{by[p].hit_rate:6.3f} ({by[p].misses_per_step:7.2f})" for p in pols]
            lines.append(f"  {k:>4} {k / r0.num_experts:5.2f}  " + "  ".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def plot(results: Sequence[ReplayResult], png: str) -> None:
    """Hit rate against K/E, one line per policy, one panel per trace."""
    _optional("matplotlib", "--png ").use("Agg")
    plt = _optional("matplotlib.pyplot", "--png ")
    names = list(dict.fromkeys(r.trace for r in results))
    cols = min(4, len(names))
    rows_n = -(-len(names) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.6 * rows_n), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        rows = [r for r in results if r.trace == name]
        for pol in dict.fromkeys(r.policy for r in rows):
            pts = sorted((r.num_slots / r.num_experts, r.hit_rate) for r in rows if r.policy == pol)
            ax.plot(*zip(*pts), marker="o", label=pol, linestyle="--" if pol == "belady" else "-")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("K / E")
        ax.set_ylabel("hit rate")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def cmd_trace(args: argparse.Namespace) -> int:
    traces = _optional("moepage.planning.traces")
    loaded = [traces.load_trace(spec) for spec in args.paths]
    grids = [(trace, _ks(args.k, trace.num_experts)) for trace in loaded]
    results: list[ReplayResult] = []
    for trace, ks in grids:
        results += traces.replay_grid(trace, ks, args.policies, warm=args.warm)
    print(format_table(results))
    if args.png:
        plot(results, args.png)
        print(f"wrote {args.png}")
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    synthetic, traces = _optional("moepage.planning.synthetic"), _optional("moepage.planning.traces")
    if args.uniform:
        gen = synthetic.uniform(args.layers, args.experts, args.top_k, args.locality, args.seed)
    else:
        gen = synthetic.calibrated(args.locality, args.seed, args.calibration)
    ids = synthetic.synthetic_ids(gen, args.tokens, args.batch)
    traces.save_simple(args.out, ids, gen.num_experts, gen.top_k)
    repeat = synthetic.repeat_rate(ids[: min(len(ids), 500), :, : gen.top_k])
    print(f"wrote {args.out}: ids {list(ids.shape)} (steps, layers, batch*top_k), E={gen.num_experts}, "
          f"top_k={gen.top_k}, locality={gen.locality:g}, repeat rate {repeat:.3f}")
    return 0


def cmd_plan_split(args: argparse.Namespace) -> int:
    """``plan --trace T --budget N``: split N slots over the trace's layers (``moepage.planning.budgets``)."""
    traces = _optional("moepage.planning.traces", "moepage plan --trace: ")
    from .planning import budgets

    if args.budget is None:
        raise ValueError("--trace needs --budget (total slots, or a K/E fraction such as 0.5)")
    trace = traces.load_trace(args.trace)
    split = budgets.plan_split(trace, budgets.parse_budget(args.budget, trace), args.policy, jobs=args.jobs)
    print(budgets.format_split(split))
    if args.out:
        budgets.save_split(split, args.out)
        print(f"wrote {args.out}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    if args.trace is not None:
        return cmd_plan_split(args)
    if args.checkpoint is None or args.gpu_mem is None:
        raise ValueError("give CHECKPOINT_DIR and --gpu-mem, or --trace and --budget")
    size = sizing.checkpoint_size(args.checkpoint)
    fb = sizing.format_bytes
    budget, reserve = args.gpu_mem, args.reserve
    e, tk = size.num_experts, size.top_k
    k_max = size.max_resident(budget, reserve)
    ks = _ks(args.k, e) if args.k else [size.min_resident, *(round(f * e) for f in (0.25, 0.5, 0.75)), k_max, e]
    print(f"checkpoint: {args.checkpoint} ({len(size.files)} safetensors files, {fb(size.total_bytes)})")
    print(f"MoE layers: {size.num_layers}, E = {e}, top_k = {tk if tk else 'unknown (no config.json)'}")
    per = sorted(set(size.expert_bytes))
    print(f"per-expert bytes: {' / '.join(f'{b} ({fb(b)})' for b in per)} per layer")
    print(f"one slot across {size.num_layers} layers: {size.slot_bytes} ({fb(size.slot_bytes)})")
    print(f"routed experts, all: {fb(size.experts_total_bytes)}; "
          f"everything else (dense, always on device): {fb(size.dense_bytes)}")
    print(f"budget {fb(budget)}, reserve {fb(reserve)}")
    if k_max == 0:
        need = size.device_bytes(size.min_resident) + reserve
        print(f"infeasible: K = {size.min_resident} needs {fb(need)} (dense + {size.min_resident} slots + reserve)")
        return 1
    print(f"feasible K: {size.min_resident}..{k_max} (K/E {size.min_resident / e:.3f}..{k_max / e:.3f})")
    print(f"  {'K':>5} {'K/E':>6} {'weights on device':>18} {'left for KV/activations':>24}")
    for k in sorted(set(ks)):
        used = size.device_bytes(k)
        left = budget - used
        note = "" if size.min_resident <= k <= k_max else "  (over budget)" if left < reserve else "  (below top_k)"
        print(f"  {k:>5} {k / e:6.3f} {fb(used):>18} {fb(left):>24}{note}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line, like every other error of the command."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moepage", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trace", help="replay routing traces for K values and eviction policies")
    t.add_argument("paths", nargs="+", help="trace files (formats: moepage.planning.traces); PATH#part selects a part")
    t.add_argument("--k", default="0.25,0.5,0.75", help="K values: fractions of E (with a '.') or absolute slot counts")
    t.add_argument("--policies", default="lru,lfu,lfru,belady",
                   type=_typed(lambda text: [policies.canonical(x) for x in _csv(text)]),
                   help="lru, lfu, lfru, lfu:H or lfru:H (half-life H waves), belady")
    t.add_argument("--png", help="write a plot of hit rate against K/E (needs matplotlib)")
    t.add_argument("--warm", action="store_true", help="start with experts 0..K-1 resident (as after wrap), not empty")
    t.set_defaults(func=cmd_trace)
    s = sub.add_parser("synth", help="write a synthetic routing trace (simple npz format)")
    s.add_argument("out")
    s.add_argument("--tokens", type=_number(int, 1), default=2000, help="decode steps")
    s.add_argument("--locality", type=_number(float, 0.0, 1.0), default=0.0,
                   help="probability of keeping each of the previous token's experts, 0..1")
    s.add_argument("--batch", type=_number(int, 1), default=1, help="independent token streams per step")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--uniform", action="store_true", help="uniform popularity (the worst case), not the calibration's")
    s.add_argument("--layers", type=_number(int, 1), default=48, help="with --uniform")
    s.add_argument("--experts", type=_number(int, 1), default=128, help="with --uniform")
    s.add_argument("--top-k", type=_number(int, 1), default=8, help="with --uniform")
    s.add_argument("--calibration", help="aggregates JSON of per-layer expert heat (default: shipped with moepage, "
                   "a real 48-layer, 128-expert, top-8 model's)")
    s.set_defaults(func=cmd_synth)
    pl = sub.add_parser("plan", help="choose K for a checkpoint and a GPU memory budget (headers only), "
                        "or split a total slot budget over layers from a trace (--trace)")
    pl.add_argument("checkpoint", nargs="?",
                    help="checkpoint directory (safetensors + config.json) or one .safetensors file")
    pl.add_argument("--gpu-mem", type=_typed(sizing.parse_bytes), help="GPU memory budget, e.g. 16GiB, 80GB")
    pl.add_argument("--reserve", default=0, type=_typed(sizing.parse_bytes),
                    help="memory kept for KV cache / activations, e.g. 4GiB")
    pl.add_argument("--k", help="K values to tabulate (fractions of E with a '.', or absolute)")
    pl.add_argument("--trace", help="routing trace (see moepage trace): split --budget over its layers")
    pl.add_argument("--budget", help="with --trace: total slots over all layers, or a K/E fraction (with a '.')")
    pl.add_argument("--policy", default=DEFAULT_POLICY, help=f"with --trace: replay policy (default {DEFAULT_POLICY})")
    pl.add_argument("--out", help="with --trace: write the split here (JSON, for moepage.planning.budgets.load_split)")
    pl.add_argument("--jobs", type=int, default=None, help="with --trace: replay processes (default: one per CPU)")
    pl.set_defaults(func=cmd_plan)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:  # ConfigError is a ValueError: bad input, not a bug
        print(f"moepage {args.command}: {str(exc).replace(chr(10), ' ')}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
