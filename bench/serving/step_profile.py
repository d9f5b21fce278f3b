"""Where an engine's decode step spends its GPU time: planning, page-in, the expert GEMMs and the rest, from a
torch-profiler trace of decode steps in the scheduler (SGLang's ``Engine.start_profile``, decode stage only, GPU
activity). Kernels go to a category by name (``CATEGORIES``); copies from host memory count as page-in. The engine
bench's ``profile`` phase (``sglang_engine.py``) runs it at each batch size; this module also reads the traces.

Captured decode replays a CUDA graph: its kernels appear in the trace one by one, as eager ones do."""

from __future__ import annotations

import gzip
import json
import time
from collections import Counter
from pathlib import Path

STEPS = 8  # decode steps profiled at each batch size
CATEGORIES = (  # (category, substrings of kernel names), first match wins
    ("planning", ("_plan_kernel", "_ranks_kernel")),  # moepage's device planner (kernels.planner, kernels.ranks)
    ("page-in", ("_gather_kernel", "_decode_kernel", "Memcpy HtoD")),  # moepage's gather and decode, host copies
    ("expert GEMMs", ("fused_moe_kernel", "moe_align", "moe_sum", "act_and_mul", "count_and_sort", "grouped_mm",
                      "marlin")),  # SGLang's MoE runners
)
REST = "rest"


def category(name: str) -> str:
    for label, parts in CATEGORIES:
        if any(p in name for p in parts):
            return label
    return REST


def device_events(trace: dict) -> list[dict]:
    """The trace's GPU work: kernels and memory copies, each with a name and a duration (µs)."""
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")]


def read_trace(path: Path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def summarize(paths: list[Path], steps: int) -> dict:
    """Per decode step: GPU µs in all and by category, each category's share, and the rest's largest kernels."""
    by_kernel: Counter[str] = Counter()
    for path in paths:
        for event in device_events(read_trace(path)):
            by_kernel[event["name"]] += float(event.get("dur", 0.0))
    totals: Counter[str] = Counter()
    for name, us in by_kernel.items():
        totals[category(name)] += us
    step_us = sum(totals.values()) / steps
    labels = [label for label, _ in CATEGORIES] + [REST]
    return dict(steps=steps, traces=[p.name for p in paths], step_us=step_us,
                us={label: totals[label] / steps for label in labels},
                share={label: totals[label] / max(sum(totals.values()), 1e-9) for label in labels},
                rest_top=[(name, us / steps) for name, us in by_kernel.most_common() if category(name) == REST][:8])


def request(where: Path) -> dict:
    """``Engine.start_profile``'s arguments (SGLang's ``ProfileReq``): GPU activity of ``STEPS`` decode steps into
    ``where``; the profiler stops by itself after them."""
    return dict(output_dir=str(where), activities=["GPU"], profile_by_stage=True, profile_stages=["decode"],
                num_steps=STEPS, with_stack=False, record_shapes=False)


def profile_decode(eng, batches: dict[int, list[list[int]]], new_tokens: int, out: Path, wait_s: float = 60.0) -> dict:
    """Profile ``STEPS`` decode steps of each batch (``batches``: size -> prompts; warmed up first) in ``eng``'s
    scheduler; per batch size, ``summarize``'s figures, or why there are none."""
    found = {}
    for b, prompts in batches.items():
        where = out / f"batch{b}"
        where.mkdir(parents=True, exist_ok=True)
        params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
        eng.generate(input_ids=prompts, sampling_params=params)  # warm-up
        try:
            eng.start_profile(**request(where))
        except Exception as exc:  # noqa: BLE001 - the engine's own refusal, reported instead of failing the run
            found[str(b)] = dict(error=f"start_profile: {exc!r}")
            continue
        eng.generate(input_ids=prompts, sampling_params=params)
        deadline = time.monotonic() + wait_s  # the scheduler writes the trace after its last profiled step
        while not (paths := sorted(where.glob("*.trace.json*"))) and time.monotonic() < deadline:
            time.sleep(0.5)
        found[str(b)] = summarize(paths, STEPS) if paths else dict(error=f"no trace in {where} after {wait_s:.0f} s")
    return dict(batches=found)


def rows(results: dict) -> list[dict]:
    """Report rows: each run's profiled batch sizes, µs a step and each category's share."""
    out = []
    for name, r in results.items():
        for b, p in (((r.get("phases") or {}).get("profile") or {}).get("batches") or {}).items():
            if "error" in p:
                out.append(dict(run=name, batch=int(b), step_us=None, note=p["error"]))
                continue
            row = dict(run=name, batch=int(b), step_us=p["step_us"])
            row.update({f"{label} %": 100 * share for label, share in p["share"].items()})
            row["rest, largest"] = ", ".join(n for n, _ in p["rest_top"][:3])
            out.append(row)
    return out
