"""How far a split step (``cpu_share``) is from the unpaged model, on a trained model and held-out text (CPU work).

A checkpoint ``bench.models.train_moe`` wrote (default: the committed tiny one, tests/data/tiny_moe) runs unpaged and
paged with a forced CPU share (every miss on the CPU by default: the largest difference the mode can make), in float32
and bf16, over validation windows of its corpus (files it never trained on):

- per layer: max |output - unpaged| of each experts module on the unpaged model's own inputs to it (each layer alone,
  no drift from the layers before), and the largest |unpaged output| beside it;
- end to end: max |logits - unpaged| and greedy-token agreement, teacher-forced over the windows (the argmax at every
  position) and free-running (greedy decode from each window's first tokens, token by token with a KV cache: the share
  of generated tokens equal to the unpaged model's before the first difference, and how many runs match entirely).

Two CPU experts: ``cpu``, the one the mode runs (torch's CPU GEMMs in the rows' dtype); on a host without a GPU the
device's waves run the same CPU kernels, so it matches the unpaged model bit for bit there, and the difference a GPU's
kernels make is measured with ``--device cuda``. ``float64`` stands in for a kernel of other rounding where no GPU is:
each CPU expert computed in float64 from the same rows, rounded once (as exact as a kernel gets), so its difference
from the unpaged model is the unpaged kernel's own rounding, the order a GPU-vs-CPU difference takes.

    python -m bench.analysis.cpu_split_exactness --out bench/analysis/cpu_split_exactness.json
    python -m bench.analysis.cpu_split_exactness --checkpoint /tmp/mid_moe --share 0.5

Writes JSON and prints a markdown table (docs/cpu-split.md holds the committed one)."""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

import moepage
from moepage.integrations.transformers import from_pretrained

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny_moe"


def windows(seq: int, count: int) -> torch.Tensor:
    """``count`` held-out windows of ``seq`` tokens (the validation split of the training corpus)."""
    from bench.models.train_moe import corpus, val_windows

    return val_windows(corpus("val", max_bytes=4_000_000), seq - 1, count)


def unpaged(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().requires_grad_(False)


def experts_inputs(model, ids: torch.Tensor) -> dict[str, list[tuple]]:
    """Each experts module's inputs (hidden, top_k_index, top_k_weights) and output, on ``ids``."""
    seen: dict[str, list[tuple]] = {}
    hooks = []
    for qual, module in moepage.find_experts(model):
        def hook(mod, args, out, qual=qual):
            seen.setdefault(qual, []).append((*[a.detach().clone() for a in args], out.detach().clone()))

        hooks.append(module.register_forward_hook(hook))
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, new: int) -> list[int]:
    """``new`` greedy tokens after ``prompt`` [1, T] (KV cache: one token per decode step)."""
    out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=257)
    return out[0, prompt.shape[1]:].tolist()


class Float64Expert:
    """A layer's CPU expert computed in float64 (its rows and inputs upcast): the ``float64`` stand-in."""

    def __init__(self, expert):
        self.expert, self.kind, self.hidden_size, self.params = expert, expert.kind + "/float64", \
            expert.hidden_size, expert.params

    def __call__(self, x, rows):
        return self.expert(x.double(), {n: r.double() for n, r in rows.items()}).float()


@torch.no_grad()
def measure(path: Path, dtype: torch.dtype, k: int, share: float, seq: int, count: int, prompt: int, new: int,
            expert: str = "cpu", device: str = "cpu") -> dict:
    ref = unpaged(path, dtype).to(device)
    paged = from_pretrained(str(path), k, device=device, dtype=dtype, cpu_share=share, progress=False)
    if expert == "float64":
        for layer in moepage.paged_layers(paged):
            layer.pager.split.expert = Float64Expert(layer.pager.split.expert)
    data = windows(seq, count).to(device)
    layers: dict[str, dict] = {}
    agree = total = 0
    logits_diff = 0.0
    for window in data:
        ids = window[None, :-1]
        for qual, calls in experts_inputs(ref, ids).items():
            module = paged.get_submodule(qual)
            row = layers.setdefault(qual, {"max_abs_diff": 0.0, "max_abs_unpaged": 0.0})
            for hidden, index, weights, want in calls:
                got = module(hidden, index, weights)
                row["max_abs_diff"] = max(row["max_abs_diff"], (got.float() - want.float()).abs().max().item())
                row["max_abs_unpaged"] = max(row["max_abs_unpaged"], want.float().abs().max().item())
        want, got = ref(ids).logits.float(), paged(ids).logits.float()
        logits_diff = max(logits_diff, (got - want).abs().max().item())
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += ids.numel()
    runs = []
    for window in data:
        p = window[None, :prompt]
        a, b = greedy(ref, p, new), greedy(paged, p, new)
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        runs.append(same)
    stats = moepage.stats(paged).total
    return {
        "dtype": str(dtype).removeprefix("torch."), "k": k, "share": share, "expert": expert, "device": device,
        "layers": layers,
        "max_abs_logits_diff": logits_diff,
        "teacher_forced_agreement": agree / total, "teacher_forced_tokens": total,
        "greedy_runs": len(runs), "greedy_tokens": new, "greedy_identical_runs": sum(r == new for r in runs),
        "greedy_tokens_before_first_difference": runs,
        "cpu_experts": stats.cpu, "paged_experts": stats.misses, "hits": stats.hits,
    }


@torch.no_grad()
def bf16_against_float32(path: Path, seq: int, count: int, device: str = "cpu") -> dict:
    """For scale: the unpaged model in bf16 against itself in float32 (teacher-forced argmax agreement, max |logits
    difference|) over the same windows."""
    data = windows(seq, count).to(device)
    a, b = unpaged(path, torch.float32).to(device), unpaged(path, torch.bfloat16).to(device)
    agree = total = 0
    diff = 0.0
    for window in data:
        ids = window[None, :-1]
        x, y = a(ids).logits.float(), b(ids).logits.float()
        diff = max(diff, (x - y).abs().max().item())
        agree += int((x.argmax(-1) == y.argmax(-1)).sum())
        total += ids.numel()
    return {"teacher_forced_agreement": agree / total, "max_abs_logits_diff": diff}


def table(results: list[dict]) -> str:
    lines = ["| CPU expert | dtype | layer | max \\|output - unpaged\\| | max \\|unpaged\\| | relative |",
             "|---|---|---|---:|---:|---:|"]
    for r in results:
        for qual, row in r["layers"].items():
            rel = row["max_abs_diff"] / row["max_abs_unpaged"] if row["max_abs_unpaged"] else 0.0
            lines.append(f"| {r['expert']} | {r['dtype']} | {qual} | {row['max_abs_diff']:.3g} | "
                         f"{row['max_abs_unpaged']:.3g} | {rel:.2e} |")
    lines += ["", "| CPU expert | dtype | CPU experts / paged / hits | max \\|logits - unpaged\\| "
              "| teacher-forced argmax agreement | greedy runs identical "
              "| greedy tokens before a difference (mean of runs) |",
              "|---|---|---|---:|---:|---:|---:|"]
    for r in results:
        runs = r["greedy_tokens_before_first_difference"]
        lines.append(f"| {r['expert']} | {r['dtype']} | {r['cpu_experts']} / {r['paged_experts']} / {r['hits']} | "
                     f"{r['max_abs_logits_diff']:.3g} | {r['teacher_forced_agreement']:.4%} "
                     f"({r['teacher_forced_tokens']} tokens) | {r['greedy_identical_runs']} of {r['greedy_runs']} "
                     f"| {sum(runs) / len(runs):.1f} of {r['greedy_tokens']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=TINY)
    ap.add_argument("--k", type=int, default=None, help="resident experts per layer (default: top_k)")
    ap.add_argument("--share", type=float, default=1.0, help="the CPU's share of each step's misses")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--expert", choices=("cpu", "float64"), action="append",
                    help="the CPU expert(s) to measure (default: both; module doc)")
    ap.add_argument("--device", default="cpu", help="where the model and the slots go (cuda: a GPU's kernels)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = json.loads((args.checkpoint / "config.json").read_text())
    k = args.k or config["num_experts_per_tok"]
    start = time.perf_counter()
    results = [measure(args.checkpoint, dtype, k, args.share, args.seq, args.windows, args.prompt, args.new, expert,
                       args.device)
               for expert in args.expert or ("cpu", "float64") for dtype in (torch.float32, torch.bfloat16)]
    scale = bf16_against_float32(args.checkpoint, args.seq, args.windows, args.device)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    report = {"checkpoint": str(args.checkpoint.relative_to(ROOT) if args.checkpoint.is_relative_to(ROOT)
                                else args.checkpoint), "commit": commit.strip(), "torch": torch.__version__,
              "seconds": round(time.perf_counter() - start, 1), "results": results,
              "unpaged_bf16_against_float32": scale}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(results))
    print(f"\nFor scale, the unpaged model in bf16 against float32: max |logits difference| "
          f"{scale['max_abs_logits_diff']:.3g}, teacher-forced argmax agreement "
          f"{scale['teacher_forced_agreement']:.4%}")


if __name__ == "__main__":
    main()
