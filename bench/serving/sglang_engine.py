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
- ``sequential``: the same 16 prompts one after another, 64 new tokens each (every request
  prefills host-planned, then decodes in CUDA graphs);
- ``concurrent``: the 16 prompts arriving 25 ms apart on the async API, twice (the second pass
  shows how far timing alone moves greedy tokens);
- ``tput``: for 1, 8 and 32 prompts of 128 tokens (``auto`` runs: 32): a warm-up, a
  prefill-only pass (one new token) and a full pass (64 new tokens); decode time = full -
  prefill-only.
Around every phase ``Engine.flush_cache()`` makes moepage's plugin dump the scheduler process's
paged-layer counters and GPU memory (``MOEPAGE_STATS_PATH``, moepage.integrations.sglang.dump).
After shutdown the child measures one pinned 1 GiB host-to-device copy (the link's peak) for the
physics bound.

Skips, saying why, where there is no CUDA or no sglang.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from bench.serving import sglang_ckpt as ckpt
from bench.serving import sglang_report
from bench.serving.sglang_runs import (
    BASE,
    CHILD_VARS,
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
    keys = ("steps", "waves", "hits", "misses", "bytes_paged", "paging_seconds")
    return {k: after["total"][k] - before["total"][k] for k in keys}


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
            if phase == "batch":
                outs = eng.generate(input_ids=base, sampling_params=[greedy(n) for n in BATCH_NEW_TOKENS])
                got = dict(outputs=[o["output_ids"] for o in outs])
            elif phase == "sequential":
                got = dict(outputs=[eng.generate(input_ids=p, sampling_params=greedy(NEW_TOKENS))["output_ids"]
                                    for p in base])
            elif phase == "concurrent":
                got = dict(outputs=_concurrent(eng, base), outputs_b=_concurrent(eng, base))
            elif phase == "tput":
                got = _throughput(eng, stats, spec.vocab, run.tput_batches)
            else:
                raise ValueError(phase)
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
    try:
        from bench.common import memcpy_gbs

        result["memcpy_gbs"] = memcpy_gbs()
    except Exception as exc:  # the bound then uses another run's figure
        result["memcpy_error"] = repr(exc)
    save("ok")


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


def _throughput(eng, stats: Stats, vocab: int, batches) -> dict:
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
        outs = eng.generate(input_ids=batch, sampling_params=greedy(NEW_TOKENS))
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


def _say_written(took: dict, spec) -> None:
    for p, s in took.items():
        print(f"wrote {p} ({spec.experts_bytes / 1e9:.1f} GB of bf16 experts) in {s:.1f} s", flush=True)


def launch(run, out: Path, ckpt_dir: Path, timeout: float, cmd: list[str] | None = None, env: dict | None = None,
           module: str = "bench.serving.sglang_engine") -> dict:
    """Run ``run`` in a child process of ``module`` (its own session; ``cmd`` replaces the child's command in tests,
    ``env`` its environment, an SGLang run's ``child_env`` by default); its result, or why it has none."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{run.name}.log"
    cmd = cmd or [sys.executable, "-m", module, "--child", run.name, "--out", str(out), "--ckpt-dir", str(ckpt_dir)]
    t0 = time.perf_counter()
    env = child_env(run, out) if env is None else env
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        _kill_group(proc)
    path = out / f"{run.name}.json"
    result = json.loads(path.read_text()) if path.exists() else dict(run=run.name, spec=asdict(run), phases={})
    result["wall_s"] = time.perf_counter() - t0
    if rc != 0 or result.get("status") != "ok":
        result["status"] = "timeout" if rc is None else "failed"  # phases already saved are kept
        result["returncode"] = rc
        text = log.read_text(errors="replace")
        result["log_tail"] = text[-8000:]
        result["tracebacks"] = tracebacks(text)[-3:]
        path.write_text(json.dumps(result))
        print_failure(run.name, text, rc)
    return result


def _kill_group(proc: subprocess.Popen) -> None:
    """End the child's session (SGLang's scheduler and detokenizer processes with it)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(1 if sig == signal.SIGTERM else 0)


_RANK = re.compile(r"^\[rank\d+\]:\s?")
_LOG_LINE = re.compile(r"^\[?\d{4}-\d\d-\d\d")  # a timestamped log line: the next record


def tracebacks(text: str, tail: int = 40) -> list[str]:
    """The tracebacks (with SGLang's "Scheduler hit an exception" line before one) of a log, in
    order, each up to the end of its exception's message, however many lines that message has
    (at most ``tail`` lines after the exception line)."""
    blocks, cur, after = [], None, -1
    for raw in text.splitlines():
        line = _RANK.sub("", raw)
        if "Traceback (most recent call last)" in line or "Scheduler hit an exception" in line:
            if cur and not (len(cur) == 1 and "Scheduler hit" in cur[0]):
                blocks.append("\n".join(cur))
                cur = None
            cur = (cur or []) + [line]
            after = -1
            continue
        if cur is None:
            continue
        if after >= 0 and (not line.strip() or _LOG_LINE.match(line) or after >= tail):
            blocks.append("\n".join(cur))
            cur, after = None, -1
            continue
        cur.append(line)
        if after >= 0:
            after += 1
        elif line and not line[0].isspace() \
                and not line.startswith(("During handling", "The above exception", "Traceback")) \
                and any(x.startswith("  File") for x in cur):
            after = 0  # the exception line: its message may go on for several lines
    if cur:
        blocks.append("\n".join(cur))
    return blocks


def print_failure(name: str, text: str, rc) -> None:
    print(f"\n===== {name}: FAILED (exit {rc}); its whole log follows =====", flush=True)
    print(text, flush=True)
    found = tracebacks(text)
    if found:
        print(f"===== {name}: the {len(found)} traceback(s) of that log =====")
        for block in found:
            print(block + "\n")
    print(f"===== end of {name} =====\n", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/moepage_sglang_bench"))
    ap.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/moepage_sglang_ckpt"))
    ap.add_argument("--only", help="runs or groups, comma-separated (default: all)")
    ap.add_argument("--budget", type=float, default=500.0,
                    help="seconds for this call: a run starts only if its estimate fits, and is stopped at the end")
    ap.add_argument("--force", action="store_true", help="run again the runs already ok in --out")
    ap.add_argument("--report", action="store_true", help="only assemble REPORT.md and the plot from --out")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.list:
        for g, names in GROUPS.items():
            print(f"{g}: {', '.join(names)}")
        return 0
    if args.child:
        run_child(RUNS[args.child], args.out, args.ckpt_dir)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        print(sglang_report.write_report(args.out))
        return 0
    why = unavailable()
    if why:
        print(f"SKIPPED: bench.serving.sglang_engine needs a CUDA GPU with sglang: {why}")
        return 0
    runs = select(args.only)
    t0 = time.perf_counter()
    write_checkpoints(runs, args.ckpt_dir)
    write_routes(runs, args.out)
    for run in runs:
        path = args.out / f"{run.name}.json"
        if not args.force and path.exists() and json.loads(path.read_text()).get("status") == "ok":
            print(f"{run.name}: already ok in {args.out}", flush=True)
            continue
        left = args.budget - (time.perf_counter() - t0)
        if left < run.estimate:
            print(f"{run.name}: not started, {left:.0f} s of the budget left (it needs about {run.estimate} s)",
                  flush=True)
            continue
        print(f"{run.name}: starting ({left:.0f} s of the budget left)", flush=True)
        result = launch(run, args.out, args.ckpt_dir, timeout=min(run.timeout, left))
        print(f"{run.name}: {result['status']} in {result['wall_s']:.0f} s "
              f"(engine up in {result.get('load_s', 0):.0f} s)", flush=True)
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
