"""What the engine benchmarks (``sglang_engine``, ``vllm_engine``) share of running a matrix of runs: the command
line, ``--only``'s choice of runs and groups, the resumable loop that starts each run within the call's budget and
skips the runs already ok, and the child process of one run (one engine a process, its log and tracebacks)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path


def parser(doc: str, out: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(out))
    ap.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/moepage_sglang_ckpt"))
    ap.add_argument("--only", help="runs or groups, comma-separated (default: all)")
    ap.add_argument("--budget", type=float, default=500.0,
                    help="seconds for this call: a run starts only if its estimate fits, and is stopped at the end")
    ap.add_argument("--force", action="store_true", help="run again the runs already ok in --out")
    ap.add_argument("--report", action="store_true", help="only assemble the report from --out")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    return ap


def index(runs: list) -> tuple[dict[str, object], dict[str, list[str]]]:
    """The runs by name, and each group's run names, in matrix order."""
    by_name = {r.name: r for r in runs}
    return by_name, {g: [r.name for r in runs if r.group == g] for g in dict.fromkeys(r.group for r in runs)}


def answered(args, runs: Mapping[str, object], groups: Mapping[str, list[str]], child: Callable,
             report: Callable[[Path], str], unavailable: Callable[[], str | None], what: str) -> bool:
    """The calls that start no matrix, done: ``--list``, ``--child RUN`` (``child(run, out, ckpt_dir)``),
    ``--report``, and a machine that cannot run it (``unavailable()`` says why); whether one was."""
    if args.list:
        for g, names in groups.items():
            print(f"{g}: {', '.join(names)}")
        return True
    if args.child:
        child(runs[args.child], args.out, args.ckpt_dir)
        return True
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        print(report(args.out))
        return True
    if why := unavailable():
        print(f"SKIPPED: {what}: {why}")
        return True
    return False


def select(only: str | None, runs: Mapping[str, object], groups: Mapping[str, list[str]]) -> list:
    """The runs named by ``--only`` (run names or group names, comma-separated), in matrix order."""
    if not only:
        return list(runs.values())
    names: set[str] = set()
    for item in (s.strip() for s in only.split(",") if s.strip()):
        if item not in groups and item not in runs:
            raise SystemExit(f"--only: unknown run or group {item!r}; see --list")
        names.update(groups.get(item, [item]))
    return [r for r in runs.values() if r.name in names]


def run_all(runs: list, out: Path, budget: float, force: bool, start: Callable[[object, float], dict]) -> None:
    """Start each of ``runs`` (``start(run, seconds left)`` returns its result) unless ``out`` has it ok already
    (``force``: again) or less of ``budget`` is left than its estimate."""
    t0 = time.perf_counter()
    for run in runs:
        path = out / f"{run.name}.json"
        if not force and path.exists() and json.loads(path.read_text()).get("status") == "ok":
            print(f"{run.name}: already ok in {out}", flush=True)
            continue
        left = budget - (time.perf_counter() - t0)
        if left < run.estimate:
            print(f"{run.name}: not started, {left:.0f} s of the budget left (it needs about {run.estimate} s)",
                  flush=True)
            continue
        print(f"{run.name}: starting ({left:.0f} s of the budget left)", flush=True)
        result = start(run, left)
        print(f"{run.name}: {result['status']} in {result['wall_s']:.0f} s "
              f"(engine up in {result.get('load_s', 0):.0f} s)", flush=True)


def launch(run, out: Path, ckpt_dir: Path, timeout: float, env: dict, module: str,
           cmd: list[str] | None = None) -> dict:
    """Run ``run`` in a child process of ``module`` (``--child``; its own session, so that nothing an engine kills on
    a failure reaches this one) with ``env``; ``cmd`` replaces the child's command in tests. Its result (the
    ``RUN.json`` the child wrote), or why it has none: a failed child's log is printed whole, its tracebacks last."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{run.name}.log"
    cmd = cmd or [sys.executable, "-m", module, "--child", run.name, "--out", str(out), "--ckpt-dir", str(ckpt_dir)]
    t0 = time.perf_counter()
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
