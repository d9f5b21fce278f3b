"""SGLang end to end on a GPU: correctness and throughput of the real ``sglang.Engine``, unpaged,
paged by moepage and paged by SGLang's built-in paged experts, on random-weight checkpoints it
writes itself (``sglang_ckpt.py``). The report is ``sglang_report.py``.

    python -m bench.serving.sglang_engine --out DIR [--only RUN|GROUP[,..]] [--budget 500] [--force]
    python -m bench.serving.sglang_engine --out DIR --report      # REPORT.md + sglang_engine.png from DIR
    python -m bench.serving.sglang_engine --list                  # the runs and groups

Runs and groups: ``--list`` (``sglang_runs``). Every run is one engine in its own process
(``--child``; engines do not share a process), started in its own session so that nothing SGLang
kills on a failure reaches this one. It writes
``DIR/RUN.json`` after every phase, so an interrupted call resumes where it stopped: runs whose
JSON says ``ok`` are skipped unless ``--force``. A child's whole output goes to
``DIR/logs/RUN.log``; on any failure that log is printed in full, its tracebacks last.
``--budget`` (seconds) stops starting runs that would not finish within it.

Phases of a run (greedy, ``ignore_eos``, ``input_ids`` prompts, no tokenizer, no radix cache):
- ``batch``: 16 prompts of 1-200 tokens submitted at once, 8-64 new tokens each, so the decode
  batch shrinks from 16 to 1 and host-planned steps interleave with captured decode;
- ``sequential``: the same 16 prompts one after another, 64 new tokens each (a run's ``new_tokens``; every request
  prefills host-planned, then decodes in CUDA graphs);
- ``concurrent``: the 16 prompts arriving 25 ms apart on the async API, twice (the second pass
  shows how far timing alone moves greedy tokens);
- ``tput``: for 1, 8 and 32 prompts of 128 tokens (``auto`` runs: 32): a warm-up, a
  prefill-only pass (one new token) and a full pass (64 new tokens, or ``new_tokens``); decode time = full -
  prefill-only;
- ``profile``: at the same batch sizes, ``step_profile.STEPS`` decode steps under SGLang's profiler: where a step's
  GPU time goes (planning, page-in, expert GEMMs, the rest; ``step_profile``).
Around every phase ``Engine.flush_cache()`` makes moepage's plugin dump the scheduler process's
paged-layer counters and GPU memory (``MOEPAGE_STATS_PATH``, moepage.integrations.sglang.dump).
After shutdown the child measures one pinned 1 GiB host-to-device copy (the link's peak) for the
physics bound.

Skips, saying why, where there is no CUDA or no sglang.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from bench.serving import matrix, sglang_report, step_profile
from bench.serving import sglang_ckpt as ckpt
from bench.serving.sglang_runs import (
    BASE,
    CHILD_VARS,
    DIRECT,
    DUMMY,
    GROUPS,
    MODELS,
    NEW_TOKENS,
    QUANTIZED,
    RUNS,
    TPUT_PROMPT,
    Run,
    checkpoint_of,
    child_env,
    engine_kwargs,
    select,
    spill_dir,
    write_routes,
)

# -- prompts -------------------------------------------------------------------------------------
CORRECTNESS_LENGTHS = (5, 17, 40, 3, 64, 9, 30, 12, 200, 7, 90, 1, 33, 128, 21, 50)
BATCH_NEW_TOKENS = (64, 8, 56, 16, 48, 24, 40, 32, 64, 12, 60, 20, 52, 28, 44, 36)


def prompts(vocab: int, lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 1) for _ in range(n)] for n in lengths]


def greedy(new_tokens: int) -> dict:
    return {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}


# -- the child: one engine ---------------------------------------------------------------------
class Stats:
    """Reads the plugin's stats dump after ``Engine.flush_cache()`` (scheduler process)."""

    def __init__(self, eng, path: Path):
        self.eng, self.path, self.seq = eng, path, 0
        self.peak_allocated = self.device_used = 0

    def read(self) -> dict:
        self.eng.flush_cache()
        for _ in range(200):  # the dump is written before flush_cache replies; be lenient anyway
            if self.path.exists():
                data = json.loads(self.path.read_text())
                if data["seq"] > self.seq:
                    self.seq = data["seq"]
                    gpu = data.get("gpu") or {}
                    self.peak_allocated = max(self.peak_allocated, gpu.get("peak_allocated", 0))
                    self.device_used = max(self.device_used, gpu.get("device_used", 0))
                    return data
            time.sleep(0.05)
        raise RuntimeError(f"no stats dump at {self.path}: "
                           "is the moepage plugin loaded (entry point) in the scheduler?")


def delta(after: dict, before: dict) -> dict:
    """Counters of the paged layers between two dumps (summed over layers)."""
    keys = ("steps", "waves", "hits", "misses", "bytes_paged", "paging_seconds", "host_hits", "host_misses",
            "disk_bytes", "disk_seconds")
    return {k: after["total"].get(k, 0) - before["total"].get(k, 0) for k in keys}


def run_child(run: Run, out: Path, ckpt_dir: Path) -> None:
    import sglang as sgl

    result = dict(run=run.name, spec=asdict(run), status="started", phases={})
    path = out / f"{run.name}.json"

    def save(status: str | None = None) -> None:
        if status:
            result["status"] = status
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, path)

    spec = MODELS[run.model]
    kw = engine_kwargs(run, str(ckpt_dir / checkpoint_of(run.model)))
    result["engine_kwargs"] = kw
    env = child_env(run, out)
    for name in CHILD_VARS:  # as the parent sets them (--child alone too)
        os.environ.pop(name, None)
        if name in env:
            os.environ[name] = env[name]
    _require_plugin()  # every run: the stats dump is the plugin's; moepage runs need its layers
    stats_path = Path(env["MOEPAGE_STATS_PATH"])
    stats_path.parent.mkdir(parents=True, exist_ok=True)
    stats_path.unlink(missing_ok=True)
    save()
    t0, eng = time.perf_counter(), None
    try:
        eng = sgl.Engine(**kw)
        result["load_s"] = time.perf_counter() - t0
        stats = Stats(eng, stats_path)
        start = stats.read()
        layers = start["layers"]
        result["layers"] = {k: {"num_experts": v["num_experts"], "num_slots": v["num_slots"]}
                            for k, v in layers.items()}
        result["auto_k"] = start.get("auto_k")
        if (run.impl == "moepage") != bool(layers):
            raise RuntimeError(f"{run.impl} run, but {len(layers)} layers are paged by moepage in the scheduler")
        save()
        base = prompts(spec.vocab, CORRECTNESS_LENGTHS, seed=1)
        for phase in run.phases:
            before = stats.read()
            t = time.perf_counter()
            got = _phase(phase, eng, run, base, stats, out)
            got["seconds"] = time.perf_counter() - t
            got["stats"] = delta(stats.read(), before) if layers else None
            result["phases"][phase] = got
            result["gpu"] = dict(peak_allocated=stats.peak_allocated, device_used=stats.device_used)
            save()
    except BaseException:
        result["error"] = traceback.format_exc()
        save("failed")
        raise
    finally:
        if eng is not None:
            eng.shutdown()
    result.update(_machine_figures(run, out))
    save("ok")


def _phase(phase: str, eng, run: Run, base: list[list[int]], stats: Stats, out: Path) -> dict:
    """One phase of a run in its engine: its outputs or figures."""
    spec = MODELS[run.model]
    if phase == "batch":
        outs = eng.generate(input_ids=base, sampling_params=[greedy(n) for n in BATCH_NEW_TOKENS])
        return dict(outputs=[o["output_ids"] for o in outs])
    if phase == "sequential":
        return dict(outputs=[eng.generate(input_ids=p, sampling_params=greedy(run.new_tokens))["output_ids"]
                             for p in base])
    if phase == "concurrent":
        return dict(outputs=_concurrent(eng, base), outputs_b=_concurrent(eng, base))
    if phase == "tput":
        return _throughput(eng, stats, spec.vocab, run.tput_batches, run.new_tokens)
    if phase == "profile":
        batches = {b: prompts(spec.vocab, [TPUT_PROMPT] * b, seed=100 + b) for b in run.tput_batches}
        return step_profile.profile_decode(eng, batches, step_profile.STEPS + 8, out / "profiles" / run.name)
    raise ValueError(phase)


def _machine_figures(run: Run, out: Path) -> dict:
    """After the engine is down: the scheduler's peak RSS, the link's (and a disk tier's disk's) speed."""
    import resource

    figures = {"children_max_rss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}  # the scheduler's peak
    try:
        from bench.common import disk_read_gbs, memcpy_gbs

        if run.host_budget is not None:
            figures["disk_gbs"] = disk_read_gbs(spill_dir(run, out))
        figures["memcpy_gbs"] = memcpy_gbs()
    except Exception as exc:  # the bound then uses another run's figure
        figures["memcpy_error"] = repr(exc)
    return figures


def _require_plugin() -> None:
    import importlib.metadata

    from moepage.integrations.sglang import ENTRY_POINT_GROUP, ENTRY_POINT_NAME

    found = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == ENTRY_POINT_NAME]
    if not found:
        raise RuntimeError(
            f"the moepage plugin is not declared (entry point {ENTRY_POINT_NAME!r} in {ENTRY_POINT_GROUP!r}): "
            "SGLang would serve --enable-paged-experts with its built-in implementation. Install moepage "
            "(pip install --no-deps -e .) or put a moepage dist-info on PYTHONPATH (bench/gpu_sglang_lease.sh)"
        )
    allow = os.environ.get("SGLANG_PLUGINS")
    if allow and ENTRY_POINT_NAME not in [s.strip() for s in allow.split(",")]:
        raise RuntimeError(f"SGLANG_PLUGINS={allow!r} leaves the moepage plugin out")


def _concurrent(eng, base: list[list[int]], gap: float = 0.025) -> list[list[int]]:
    async def one(i: int, p: list[int]):
        await asyncio.sleep(i * gap)
        return (await eng.async_generate(input_ids=p, sampling_params=greedy(NEW_TOKENS)))["output_ids"]

    async def everything():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(base)))

    return list(eng.loop.run_until_complete(everything()))


def _throughput(eng, stats: Stats, vocab: int, batches, new_tokens: int) -> dict:
    """{"batches": {str(batch size): figures}}."""
    out = {}
    for b in batches:
        batch = prompts(vocab, [TPUT_PROMPT] * b, seed=100 + b)
        eng.generate(input_ids=batch, sampling_params=greedy(2))  # warm-up: kernels for these shapes
        s0 = stats.read()
        t = time.perf_counter()
        eng.generate(input_ids=batch, sampling_params=greedy(1))
        prefill_s = time.perf_counter() - t
        s1 = stats.read()
        t = time.perf_counter()
        outs = eng.generate(input_ids=batch, sampling_params=greedy(new_tokens))
        total_s = time.perf_counter() - t
        s2 = stats.read()
        paged = bool(s0["layers"])
        out[str(b)] = dict(
            batch=b, prompt_tokens=b * TPUT_PROMPT, new_tokens=sum(len(o["output_ids"]) for o in outs),
            prefill_s=prefill_s, total_s=total_s,
            stats_prefill=delta(s1, s0) if paged else None, stats_total=delta(s2, s1) if paged else None,
        )
    return {"batches": out}


# -- the parent: the matrix ----------------------------------------------------------------------
def unavailable() -> str | None:
    """Why this machine cannot run the benchmark (None: it can)."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (see bench/gpu_sglang_lease.sh)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def write_checkpoints(runs: list[Run], ckpt_dir: Path) -> None:
    models = {checkpoint_of(r.model) for r in runs}
    for base in ("qwen", "gptoss"):
        twins = [m for m in QUANTIZED if BASE.get(m, "qwen") == base]
        if models & {base, *twins}:
            spec = MODELS[base]
            quantized = {ckpt_dir / m: QUANTIZED[m] for m in twins if m in models}
            _say_written(ckpt.write_checkpoints(spec, ckpt_dir / base, quantized), spec)
    for plain in ("mixtral", "qwen64", "deep"):  # bf16 only, no quantized twins
        if plain in models:
            _say_written(ckpt.write_checkpoints(MODELS[plain], ckpt_dir / plain), MODELS[plain])
    for model, quant in DIRECT.items():  # in their format alone: no bf16 copy on disk
        if model in models:
            _say_written(ckpt.write_checkpoints(MODELS[model], ckpt_dir / model, quant=quant), MODELS[model])
    for model in models & set(DUMMY):  # the engines' dummy weights: the config only
        if ckpt.write_config(MODELS[model], ckpt_dir / model):
            print(f"wrote {ckpt_dir / model}: the config of {MODELS[model].layers} layers (dummy weights)", flush=True)


def _say_written(took: dict, spec) -> None:
    for p, s in took.items():
        print(f"wrote {p} ({spec.experts_bytes / 1e9:.1f} GB of bf16 experts) in {s:.1f} s", flush=True)


def launch(run: Run, out: Path, ckpt_dir: Path, timeout: float, cmd: list[str] | None = None) -> dict:
    """``run`` in a child process of its own (``matrix.launch``), with its environment (``child_env``)."""
    return matrix.launch(run, out, ckpt_dir, timeout, child_env(run, out), "bench.serving.sglang_engine", cmd)


def main(argv=None) -> int:
    args = matrix.parser(__doc__, "/tmp/moepage_sglang_bench").parse_args(argv)
    if matrix.answered(args, RUNS, GROUPS, run_child, sglang_report.write_report, unavailable,
                       "bench.serving.sglang_engine needs a CUDA GPU with sglang"):
        return 0
    runs = select(args.only)
    write_checkpoints(runs, args.ckpt_dir)
    write_routes(runs, args.out)
    matrix.run_all(runs, args.out, args.budget, args.force,
                   lambda run, left: launch(run, args.out, args.ckpt_dir, timeout=min(run.timeout, left)))
    print(sglang_report.write_report(args.out))
    return 0

if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
