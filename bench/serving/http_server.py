"""SGLang's real HTTP server through moepage's plugin, and its OpenAI-compatible API with the
``openai`` client: unpaged, paged by moepage and paged by SGLang's built-in at equal K, each
server started by ``python3 -m sglang.launch_server`` under ``--enable-deterministic-inference``.

    python -m bench.serving.http_server ckpt   --dir CKPT         # checkpoint + a word-level tokenizer
    python -m bench.serving.http_server serve  MODE --dir CKPT --out OUT [--k 32]   # MODE: unpaged|moepage|builtin
    python -m bench.serving.http_server report --out OUT          # OUT/REPORT.md from OUT/*.json

One server per ``serve`` (its own session, killed with everything it started). The client, against
``/v1/completions`` (greedy, ``ignore_eos``):
- ``sequential``: 16 prompts one after another, non-streaming;
- ``stream``: the same prompts streamed; their text must equal ``sequential``'s;
- ``concurrent``: the same prompts all at once; under deterministic inference, equal too;
- ``latency``: at concurrency 1, 8 and 32, streamed requests of 128 prompt tokens and 64 new ones:
  TTFT (request to first token) and TPOT (first to last token over the tokens after the first).
``report`` compares every mode's texts with the unpaged server's and tabulates the latencies, with
moepage / built-in ratios. The checkpoint is ``sglang_ckpt``'s Qwen3-30B-A3B shapes (4 layers,
E = 128, top-8) with a tokenizer whose tokens are the words ``t2`` .. ``t1023``, so that text
round-trips to ids and prompts need no download.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.serving import sglang_ckpt as ckpt
from bench.serving.sglang_engine import MODELS, Run, child_env, engine_kwargs

MODES = ("unpaged", "moepage", "builtin")
CONCURRENCY = (1, 8, 32)
NEW_TOKENS = 32  # correctness requests
LATENCY_PROMPT, LATENCY_NEW = 128, 64
LENGTHS = (5, 17, 40, 3, 64, 9, 30, 12, 200, 7, 90, 1, 33, 128, 21, 50)


def write_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer: ids 0 and 1 are ``<unk>`` and ``</s>``, every other id ``i`` the word ``t{i}``
    (special tokens are matched inside words, so none may be a prefix of one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {"<unk>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with one space
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "</s>", "bos_token": None,
         "model_max_length": 4096}))


def cmd_ckpt(args) -> int:
    spec = MODELS["qwen"]
    ckpt.write_checkpoints(spec, args.dir)
    write_tokenizer(args.dir, spec.vocab)
    print(f"wrote {args.dir} ({spec})")
    return 0


def server_argv(mode: str, model: Path, port: int, k: int) -> list[str]:
    """``launch_server`` flags: the engine benchmark's settings (prefill eager, decode in CUDA graphs) as flags,
    with the tokenizer and deterministic inference."""
    run = Run(f"http-{mode}", "qwen", mode, None if mode == "unpaged" else k, prefill="disabled")
    kw = engine_kwargs(run, str(model))
    kw.update(skip_tokenizer_init=False, log_level="warning", enable_deterministic_inference=True)
    argv = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port)]
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif value not in (False, None):
            argv += [flag, str(value)]
    return argv


def _get(url: str, timeout: float = 5) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except OSError:
        return 0


def start_server(argv: list[str], env: dict, log: Path, port: int, timeout: float = 360) -> subprocess.Popen:
    """Start the server and wait until it answers a generation; its log goes to ``log``."""
    proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log {log}:\n{log.read_text()[-6000:]}")
        if _get(f"http://127.0.0.1:{port}/health_generate", timeout=30) == 200:
            return proc
        time.sleep(2)
    stop_server(proc)
    raise RuntimeError(f"server not up after {timeout:.0f} s; log {log}:\n{log.read_text()[-6000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=15)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def prompts(n_tokens, vocab: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(2, vocab)}" for _ in range(n)) for n in n_tokens]


def _params(max_tokens: int) -> dict:
    return dict(model="default", max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})


def complete(client, prompt: str, max_tokens: int = NEW_TOKENS) -> str:
    return client.completions.create(prompt=prompt, **_params(max_tokens)).choices[0].text


def streamed(client, prompt: str, max_tokens: int = NEW_TOKENS) -> dict:
    """One streamed request: its text, TTFT and TPOT (ms) and the token count the server reports."""
    t0 = time.perf_counter()
    first = last = None
    text, tokens = [], None
    stream = client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True},
                                       **_params(max_tokens))
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            last = time.perf_counter()
            first = first or last
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    n = tokens or max_tokens
    return dict(text="".join(text), ttft_ms=(first - t0) * 1e3,
                tpot_ms=(last - first) * 1e3 / max(1, n - 1), tokens=n)


def _summary(rows: list[dict]) -> dict:
    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    ttft, tpot = [r["ttft_ms"] for r in rows], [r["tpot_ms"] for r in rows]
    return dict(requests=len(rows), ttft_ms=statistics.median(ttft), ttft_p90_ms=pct(ttft, 0.9),
                tpot_ms=statistics.median(tpot), tpot_p90_ms=pct(tpot, 0.9))


def client_phases(port: int, vocab: int) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=300, max_retries=0)
    base = prompts(LENGTHS, vocab, seed=1)
    out = dict(sequential=[complete(client, p) for p in base])
    out["stream"] = [streamed(client, p)["text"] for p in base]
    with ThreadPoolExecutor(len(base)) as pool:
        out["concurrent"] = list(pool.map(lambda p: complete(client, p), base))
    latency = {}
    for c in CONCURRENCY:
        batch = prompts([LATENCY_PROMPT] * max(8, 2 * c), vocab, seed=100 + c)
        with ThreadPoolExecutor(c) as pool:
            list(pool.map(lambda p: streamed(client, p, LATENCY_NEW), batch[:c]))  # warm-up
            rows = list(pool.map(lambda p: streamed(client, p, LATENCY_NEW), batch))
        latency[str(c)] = _summary(rows)
    out["latency"] = latency
    return out


def cmd_serve(args) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(f"http-{args.mode}", "qwen", args.mode, args.k)
    env = child_env(run, args.out)
    argv = server_argv(args.mode, args.dir, args.port, args.k)
    result = dict(mode=args.mode, k=None if args.mode == "unpaged" else args.k, argv=argv[1:])
    t0 = time.time()
    proc = start_server(argv, env, args.out / f"{args.mode}.server.log", args.port)
    result["server_up_s"] = time.time() - t0
    try:
        result.update(client_phases(args.port, MODELS["qwen"].vocab))
        result["status"] = "ok"
    finally:
        stop_server(proc)
        (args.out / f"{args.mode}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k in ("mode", "k", "server_up_s", "latency")}, indent=1))
    return 0


def report(results: dict[str, dict]) -> str:
    ref = results.get("unpaged", {}).get("sequential")
    lines = ["| server | K | sequential = unpaged | stream = its sequential | concurrent = unpaged |",
             "|---|---|---|---|---|"]
    for mode, r in results.items():
        seq, stream, conc = r.get("sequential", []), r.get("stream", []), r.get("concurrent", [])

        def eq(a, b):
            return f"{sum(x == y for x, y in zip(a, b))}/{len(b)}" if a and b else "-"

        lines.append(f"| {mode} | {r.get('k') or 'E'} | {eq(seq, ref)} | {eq(stream, seq)} | {eq(conc, ref)} |")
    lines += ["", "| concurrency | server | TTFT ms (p90) | TPOT ms (p90) |", "|---|---|---|---|"]
    for c in map(str, CONCURRENCY):
        for mode, r in results.items():
            s = r.get("latency", {}).get(c)
            if s:
                lines.append(f"| {c} | {mode} | {s['ttft_ms']:.1f} ({s['ttft_p90_ms']:.1f}) | "
                             f"{s['tpot_ms']:.2f} ({s['tpot_p90_ms']:.2f}) |")
        m, b = (results.get(x, {}).get("latency", {}).get(c) for x in ("moepage", "builtin"))
        if m and b:
            lines.append(f"| {c} | moepage / built-in | {m['ttft_ms'] / b['ttft_ms']:.2f} | "
                         f"{m['tpot_ms'] / b['tpot_ms']:.2f} |")
    return "\n".join(lines)


def cmd_report(args) -> int:
    results = {m: json.loads((args.out / f"{m}.json").read_text()) for m in MODES if (args.out / f"{m}.json").exists()}
    text = report(results)
    (args.out / "REPORT.md").write_text(text + "\n")
    print(text)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("ckpt")
    c.add_argument("--dir", type=Path, required=True)
    s = sub.add_parser("serve")
    s.add_argument("mode", choices=MODES)
    s.add_argument("--dir", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--k", type=int, default=MODELS["qwen"].experts // 4)
    s.add_argument("--port", type=int, default=30100)
    r = sub.add_parser("report")
    r.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    return {"ckpt": cmd_ckpt, "serve": cmd_serve, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
