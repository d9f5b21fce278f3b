"""Why a split step starts its CPU share only once its waves are queued (``moepage.split.StepShare``): the worker's
experts, one token each, timed alone, beside a driving thread that runs Python (as one queueing a step's waves does),
and beside one that waits on the worker's result (what a step does once its waves are queued). Each torch op of the
worker takes Python's lock back as it returns; a thread running Python holds that lock.

    python -m bench.kernels.worker_lock                     # Qwen3-30B-A3B's expert shapes, bf16
    python -m bench.kernels.worker_lock --hidden 64 --inter 32 --experts 4   # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A gated expert as the CPU computes one (``CpuExpert``'s arithmetic): float32 out."""
    gate, up = (x @ gate_up.t()).chunk(2, -1)
    return ((torch.nn.functional.silu(gate) * up) @ down.t()).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=8, help="experts a share computes")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    rows = [(torch.randn(2 * args.inter, args.hidden, dtype=torch.bfloat16),
             torch.randn(args.hidden, args.inter, dtype=torch.bfloat16)) for _ in range(args.experts)]
    x = torch.randn(1, args.hidden, dtype=torch.bfloat16)
    worker = ThreadPoolExecutor(1)

    def share() -> float:
        start = time.perf_counter()
        for gate_up, down in rows:
            expert(x, gate_up, down)
        return time.perf_counter() - start

    def timed(driver) -> float:
        times = []
        for _ in range(args.reps):
            future = worker.submit(share)
            driver(future)
            times.append(future.result())
        return statistics.median(times)

    def python_busy(future) -> None:  # queueing waves: Python and small torch calls until the share is done
        while not future.done():
            sum(range(200))
            torch.empty(1)

    timed(lambda f: f.result())  # warm-up
    alone = timed(lambda f: None)
    busy = timed(python_busy)
    waiting = timed(lambda f: f.result())
    print(f"{args.experts} experts of {args.hidden}x{args.inter}, 1 token, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"  alone: {alone * 1e3:.2f} ms; beside Python: {busy * 1e3:.2f} ms ({busy / alone:.2f}x); "
          f"beside a thread waiting on it: {waiting * 1e3:.2f} ms ({waiting / alone:.2f}x)")


if __name__ == "__main__":
    main()
