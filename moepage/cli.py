"""The ``moepage`` console script: ``trace`` (replay + plot), ``synth`` (write a synthetic trace),
``plan`` (choose K for a checkpoint and a GPU memory budget), ``record`` (record a model's routing as a trace).

Parsing, printing and error reporting only; the work is in ``moepage.planning`` (``record``: in the integration it
names, imported inside the command). ``plan`` runs on a base install; ``trace``, ``synth`` and ``record`` import numpy
(``--png``: matplotlib; ``record MODEL_DIR``: transformers) inside the command, naming the extra if one is missing.
Every error is one line on stderr naming the file or flag, exit status 2, said before the work (output paths too).
Long commands draw a progress bar on stderr (tqdm) when it is a terminal; ``--progress`` / ``--no-progress`` decide.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from . import __version__, units
from .errors import ConfigError
from .planning import policies, report, sizing, tiers
from .progress import progress
from .residency import DEFAULT_POLICY, POLICIES, policy_names

if TYPE_CHECKING:
    from .planning.traces import ReplayResult, Trace

EXTRAS = {"numpy": "traces", "matplotlib": "traces", "transformers": "transformers"}  # dependency -> its extra


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


def _memory(text: str) -> int:
    """A memory size (``--gpu-mem``, ``--host-mem``): a number and its unit, above zero."""
    value = units.parse_bytes(text)
    if value <= 0:
        raise ValueError(f"{text!r} is no memory: give a size above zero with its unit, e.g. 16GiB")
    return value


def _output_path(text: str) -> str:
    """A file the command will write, checked as it is parsed (before the work): not a directory, in an existing
    writable directory."""
    path = Path(text)
    if path.is_dir():
        raise ValueError(f"{text!r} is a directory; give a file path")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"{text!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{text!r}: not writable here")
    return text


_OUTPUT = _typed(_output_path)  # the argparse type of every path a command writes


def _addprogress(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr (default: when stderr is a terminal; needs tqdm)")


def _ks(text: str, num_experts: int, top_k: int | None, of: str = "") -> list[int]:
    """``--k`` values for E experts (``of``: whose), every one in top_k..E (``resolve_k``), checked before anything is
    printed."""
    try:
        return [sizing.resolve_k(x, num_experts, top_k) for x in _csv(text)]
    except ValueError as exc:
        raise ConfigError(f"--k {text}{of}: {exc}") from None


def _write(path, save, what) -> None:
    """``save(what, path)`` and say so, where the command was given a path."""
    if path:
        save(what, path)
        print(f"wrote {path}")


def cmd_trace(args: argparse.Namespace) -> int:
    traces = _optional("moepage.planning.traces")
    if args.png:
        _optional("matplotlib.pyplot", "--png ")  # a missing plotter is said before the replays, not after
    loaded = [traces.load_trace(spec) for spec in args.paths]
    grids = [(trace, _ks(args.k, trace.num_experts, trace.top_k, f" ({spec})" * (len(loaded) > 1)) if args.k
              else sizing.default_ks(trace.num_experts, trace.top_k)) for spec, trace in zip(args.paths, loaded)]
    results: list[ReplayResult] = []
    for trace, ks in grids:
        with progress(args.progress, f"replaying {trace.name}", "replay") as tick:
            results += traces.replay_grid(trace, ks, args.policies, warm=args.warm, progress=tick)
    print(report.format_table(results))
    _write(args.png, report.plot, results)
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    synthetic, traces = _optional("moepage.planning.synthetic"), _optional("moepage.planning.traces")
    if args.uniform:
        gen = synthetic.uniform(args.layers, args.experts, args.top_k, args.locality, args.seed)
    else:
        gen = synthetic.calibrated(args.locality, args.seed, args.calibration)
    with progress(args.progress, "generating", "token") as tick:
        ids = synthetic.synthetic_ids(gen, args.tokens, args.batch, progress=tick)
    traces.save_simple(args.out, ids, gen.num_experts, gen.top_k)
    repeat = synthetic.repeat_rate(ids[: min(len(ids), 500), :, : gen.top_k])
    print(f"wrote {args.out}: ids {list(ids.shape)} (steps, layers, batch*top_k), E={gen.num_experts}, "
          f"top_k={gen.top_k}, locality={gen.locality:g}, repeat rate {repeat:.3f}")
    return 0


def cmd_plan_split(args: argparse.Namespace) -> int:
    """``plan [CHECKPOINT_DIR] --trace T --budget N``: split N slots over the trace's layers
    (``moepage.planning.budgets``); a checkpoint is checked against the trace and sizes the split."""
    traces = _optional("moepage.planning.traces", "moepage plan --trace: ")
    from .planning import budgets

    if args.budget is None:
        raise ValueError("--trace needs --budget (total slots, or a K/E fraction such as 0.5)")
    size = sizing.checkpoint_size(args.checkpoint) if args.checkpoint is not None else None  # headers: quick
    trace = traces.load_trace(args.trace, num_experts=size.num_experts if size else None)
    if size is not None:
        _check_same_model(args, trace, size)
    try:
        budget = budgets.parse_budget(args.budget, trace)
    except ValueError as exc:
        raise ConfigError(f"--budget {args.budget}: {exc}") from None
    with progress(args.progress, f"miss curves of {trace.name}", "K") as tick:
        split = budgets.plan_split(trace, budget, args.policy, jobs=args.jobs, progress=tick)
    print(budgets.format_split(split))
    if size is not None:
        print(_split_bytes_line(args.checkpoint, size, split.layers))
    _write(args.out, budgets.save_split, split)
    return 0


def _model_text(layers: int, num_experts: int, top_k: int | None) -> str:
    return f"{layers} MoE layers, E={num_experts}" + (f", top_k={top_k}" if top_k else "")


def _check_same_model(args: argparse.Namespace, trace: Trace, size: sizing.CheckpointSize) -> None:
    """A split gives K per layer of one model: the trace's MoE layers, E and top_k (where the checkpoint says it)
    must be the checkpoint's, or its K would be applied to layers and experts they were not replayed for."""
    given = (len(trace.layers), trace.num_experts, trace.top_k if size.top_k else None)
    ours = (size.num_layers, size.num_experts, size.top_k)
    if given != ours:
        raise ConfigError(f"--trace {args.trace}: {_model_text(*given)}, but checkpoint {args.checkpoint} has "
                          f"{_model_text(*ours)}; a split is for the model the trace was recorded on "
                          "(moepage record CHECKPOINT_DIR)")


def _split_bytes_line(checkpoint: str, size: sizing.CheckpointSize, ks: list[int]) -> str:
    """What the split costs on the device: dense weights plus K_l slots of layer l's expert size."""
    fb = units.format_bytes
    slots = sum(k * b for k, b in zip(ks, size.expert_bytes))
    return (f"weights on device with this split ({checkpoint}): {fb(size.dense_bytes + slots)} "
            f"(dense {fb(size.dense_bytes)} + {sum(ks)} slots {fb(slots)})")


def cmd_plan(args: argparse.Namespace) -> int:
    if args.trace is not None:
        return cmd_plan_split(args)
    if args.checkpoint is None:
        raise ValueError("give CHECKPOINT_DIR (with --gpu-mem to choose K), or --trace and --budget")
    if args.spill_dir is not None and (why := tiers.folder_problem(args.spill_dir, 0)):
        raise ConfigError(f"--spill-dir {args.spill_dir}: {why}")
    if args.traffic is not None and not os.path.exists(args.traffic.partition("#")[0]):
        raise ConfigError(f"--traffic {args.traffic}: no such file (a routing trace: moepage record or trace)")
    size = sizing.checkpoint_size(args.checkpoint)
    fb = units.format_bytes
    budget, reserve = args.gpu_mem, args.reserve
    e, tk = size.num_experts, size.top_k
    k_max = size.max_resident(budget, reserve) if budget is not None else 0
    ks = _ks(args.k, e, tk) if args.k else sizing.default_ks(e, size.min_resident, k_max, e)
    print(f"checkpoint: {args.checkpoint} ({len(size.files)} safetensors files, {fb(size.total_bytes)})")
    print(f"MoE layers: {size.num_layers}, E = {e}, top_k = {tk if tk else 'unknown (no config.json)'}")
    per = sorted(set(size.expert_bytes))
    print(f"per-expert bytes: {' / '.join(f'{b} ({fb(b)})' for b in per)} per layer")
    print(f"one slot across {size.num_layers} layers: {size.slot_bytes} ({fb(size.slot_bytes)})")
    print(f"routed experts, all: {fb(size.experts_total_bytes)}; "
          f"everything else (dense, always on device): {fb(size.dense_bytes)}")
    print(tiers.host_line(size, args.host_mem))
    if budget is None:  # sizes and host memory only (a CPU run, or a GPU not chosen yet)
        print("give --gpu-mem (the GPU memory for weights and KV cache) to choose K")
        return 0
    print(f"budget {fb(budget)}, reserve {fb(reserve)}")
    if k_max == 0:
        need = size.device_bytes(size.min_resident) + reserve
        print(f"infeasible: K = {size.min_resident} needs {fb(need)} (dense + {size.min_resident} slots + reserve)")
        return 1
    tier = tiers.host_tier(size, args.host_mem)
    h = e if tier is None or tier.every else tier.rows  # a disk tier takes K <= H
    if tier is not None and tier.short:
        print(f"infeasible: {fb(tier.available)} of host memory ({tier.source}) holds {h} rows per layer, fewer "
              f"than top_k = {size.min_resident}, even with a disk tier")
        return 1
    best = min(k_max, h)  # the largest feasible K: the GPU's and the host tier's
    bound = f", at most the host tier's H = {h} rows" if best < k_max else ""
    print(f"feasible K: {size.min_resident}..{best} (K/E {size.min_resident / e:.3f}..{best / e:.3f}{bound})")
    print(f"recommended: K = {best} (the largest K leaving the {fb(reserve)} reserve{bound}; "
          f"{fb(budget - size.device_bytes(best))} left for KV/activations)")
    if tier is not None:
        for line in tiers.tier_lines(size, best, tier, args.spill_dir, args.traffic, args.policy,
                                     lambda: _optional("moepage.planning.traces", "moepage plan --traffic: ")):
            print(line)
    print(f"  {'K':>5} {'K/E':>6} {'weights on device':>18} {'left for KV/activations':>24}")
    for k in sorted(set(ks)):
        used = size.device_bytes(k)
        left = budget - used
        note = ("  (over budget)" if k > k_max else f"  (above H = {h} host rows)" if k > h
                else "  <- recommended" * (k == best))
        print(f"  {k:>5} {k / e:6.3f} {fb(used):>18} {fb(left):>24}{note}")
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    """``record``: routing as a simple npz trace, from a checkpoint run here (``integrations.transformers.record``),
    a serving engine's recorder dump or a running server (``integrations.sglang``). Inputs checked before any run."""
    traces = _optional("moepage.planning.traces")
    from .planning import prompts

    given = [flag for flag, value in (("MODEL_DIR", args.model), ("--sglang-dump", args.sglang_dump),
                                      ("--sglang-url", args.sglang_url)) if value]
    if len(given) != 1:
        raise ValueError(f"give one of MODEL_DIR, --sglang-dump or --sglang-url (got {', '.join(given) or 'none'})")
    if args.sglang_dump and (args.prompts or args.token_ids):
        raise ValueError("--sglang-dump converts a dump; it takes no --prompts or --token-ids")
    if not args.sglang_dump and (args.prompts is None) == (args.token_ids is None):
        raise ValueError("give --prompts FILE or --token-ids FILE (one of the two)")
    if args.sglang_url and args.dump_dir is None:
        raise ValueError("--sglang-url needs --dump-dir (the server's SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR)")
    out = Path(args.out)
    if out.suffix != ".npz":  # load_trace reads a file by its suffix
        raise ValueError(f"--out {args.out}: a trace is written as simple npz; give a path ending in .npz")
    inputs = prompts.read_prompts(args.prompts) if args.prompts else prompts.read_token_ids(args.token_ids) \
        if args.token_ids else None
    progress = lambda line: print(f"moepage record: {line}", file=sys.stderr, flush=True)
    if args.model:
        _optional("transformers", "MODEL_DIR ")
        hf = _optional("moepage.integrations.transformers.record", "MODEL_DIR ")
        trace = hf.record_checkpoint(args.model, inputs, max_new_tokens=args.max_new_tokens, device=args.device,
                                     dtype=args.dtype, progress=progress)
    else:
        server = importlib.import_module("moepage.integrations.sglang.record_server")
        dump = args.sglang_dump or server.record_server(args.sglang_url, inputs, args.dump_dir, args.max_new_tokens,
                                                        progress)
        trace = importlib.import_module("moepage.integrations.sglang.routing_dump").load_dump(dump)
    traces.save_trace(trace, out)
    print(f"wrote {out}: {trace.num_steps} steps ({len(trace.prefill_steps)} prefill), {len(trace.layers)} MoE "
          f"layers, E={trace.num_experts}, top_k={trace.top_k}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line, like every other error of the command."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moepage", description=__doc__.split("\n\n")[0].replace("``", ""))  # argparse shows plain text
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trace", help="replay routing traces for K values and eviction policies")
    t.add_argument("paths", nargs="+", help="trace files (formats: moepage.planning.traces); PATH#part selects a part")
    t.add_argument("--k", help="K values in top_k..E: fractions of E (with a '.') or absolute slot counts (default: "
                   "0.25,0.5,0.75, each at least top_k)")
    t.add_argument("--policies", default=",".join([*POLICIES, "belady"]),
                   type=_typed(lambda text: [policies.canonical(x) for x in _csv(text)]),
                   help=f"{policy_names()} (half-life H waves), belady")
    t.add_argument("--png", type=_OUTPUT, help="write a plot of hit rate against K/E (needs matplotlib)")
    t.add_argument("--warm", action="store_true", help="start with experts 0..K-1 resident (as after wrap), not empty")
    _addprogress(t)
    t.set_defaults(func=cmd_trace)
    s = sub.add_parser("synth", help="write a synthetic routing trace (simple npz format)")
    s.add_argument("out", metavar="OUT", type=_OUTPUT, help="trace file to write (simple npz), exactly this path")
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
    _addprogress(s)
    s.set_defaults(func=cmd_synth)
    pl = sub.add_parser("plan", help="choose K for a checkpoint and a GPU memory budget (headers only), "
                        "or split a total slot budget over layers from a trace (--trace)")
    pl.add_argument("checkpoint", nargs="?",
                    help="checkpoint directory (safetensors + config.json) or one .safetensors file; with --trace: "
                    "checked against the trace (MoE layers, E, top_k) and sizing the split")
    pl.add_argument("--gpu-mem", type=_typed(_memory), help="GPU memory budget, a size with its unit, e.g. 16GiB, "
                    "80GB")
    pl.add_argument("--reserve", default=0, type=_typed(units.parse_bytes),
                    help="memory kept for KV cache / activations, a size with its unit, e.g. 4GiB (default 0)")
    pl.add_argument("--k", help="K values in top_k..E to tabulate (fractions of E with a '.', or absolute)")
    pl.add_argument("--host-mem", type=_typed(_memory),
                    help="host memory for expert rows, a size with its unit, e.g. 64GiB (default: what this machine "
                    "has left); below all experts' bytes, the host tier over a disk tier (K <= its H)")
    pl.add_argument("--spill-dir", type=os.path.expanduser,
                    help="with a disk tier: where moepage would keep rows (its free space)")
    pl.add_argument("--traffic", metavar="TRACE", help="with a disk tier: the disk reads per step this routing trace "
                    "expects at the recommended K and the host tier's H")
    pl.add_argument("--trace", help="routing trace (see moepage trace): split --budget over its layers")
    pl.add_argument("--budget", help="with --trace: total slots over all layers, or a K/E fraction (with a '.')")
    pl.add_argument("--policy", default=DEFAULT_POLICY, type=_typed(policies.canonical),
                    help=f"with --trace: replay policy (default {DEFAULT_POLICY})")
    pl.add_argument("--out", type=_OUTPUT,
                    help="with --trace: write the split here (JSON, for moepage.planning.budgets.load_split)")
    pl.add_argument("--jobs", type=_number(int, 1), default=None,
                    help="with --trace: replay processes (default: one per CPU)")
    _addprogress(pl)
    pl.set_defaults(func=cmd_plan)
    r = sub.add_parser("record", help="record a model's routing as a trace (simple npz) for moepage plan / trace",
                       description="Record routing into a trace: run a Hugging Face checkpoint here (MODEL_DIR: "
                       "greedy generate per prompt), convert an SGLang per_token expert distribution dump "
                       "(--sglang-dump), or drive a running SGLang server's recorder (--sglang-url).")
    r.add_argument("model", nargs="?", metavar="MODEL_DIR", help="Hugging Face checkpoint directory (transformers)")
    r.add_argument("--prompts", metavar="FILE", help="prompts file: one prompt a line, or .jsonl with a \"text\" field")
    r.add_argument("--token-ids", metavar="FILE",
                   help="token ids file: whitespace-separated ids, one prompt a line (no tokenizer)")
    r.add_argument("--out", required=True, type=_OUTPUT, metavar="T.npz", help="trace to write (.npz)")
    r.add_argument("--max-new-tokens", metavar="N", type=_number(int, 1), default=16,
                   help="new tokens per prompt (default 16)")
    r.add_argument("--device", help="with MODEL_DIR: cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    r.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="with MODEL_DIR: weights' dtype (default: the checkpoint's)")
    r.add_argument("--sglang-dump", metavar="DUMP.pt", help="convert this expert_distribution_recorder_*.pt dump")
    r.add_argument("--sglang-url", metavar="URL", help="record a server launched with "
                   "--expert-distribution-recorder-mode per_token, e.g. http://127.0.0.1:30000")
    r.add_argument("--dump-dir", metavar="DIR",
                   help="with --sglang-url: the server's SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR")
    r.set_defaults(func=cmd_record)
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
