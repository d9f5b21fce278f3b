"""vLLM end to end on a GPU: the engine check (greedy token ids of random-weight checkpoints, a batch, twice, and the
same prompts one after another, paged equal to unpaged) and decode tokens/s at batch 1 / 8 / 32 against unpaged and
vLLM's whole-parameter offload (``--cpu-offload-gb``) at equal GPU memory, on 8 layers of Qwen3-30B-A3B expert
shapes, and on all 48 (``full`` groups: vLLM's dummy weights, or a block-FP8 checkpoint; routing replayed,
``route_replay``). Checkpoints are ``sglang_ckpt``'s (Hugging Face layout, engine-neutral).

    python -m bench.serving.vllm_engine --out DIR [--only RUN|GROUP[,..]] [--budget 500] [--force]
    python -m bench.serving.vllm_engine --out DIR --report      # REPORT.md from DIR
    python -m bench.serving.vllm_engine --list

Every run is one ``vllm.LLM`` in its own process (``matrix.launch``), writing ``DIR/RUN.json`` after every
phase (resumable as the SGLang bench). A paged run reads its layers' counters from the engine's worker
(``LLM.apply_model``) and fails if none is paged there. Set-up on the H200: ``bench/gpu_vllm/README.md``.
Skips, saying why, where there is no CUDA or no vLLM."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.serving import ckpt_quant, matrix, route_replay
from bench.serving import sglang_ckpt as ckpt
from bench.serving import sglang_runs as S
from bench.serving.sglang_engine import BATCH_NEW_TOKENS, CORRECTNESS_LENGTHS, prompts
from bench.serving.sglang_report import table
from bench.serving.sglang_runs import NEW_TOKENS, TPUT_BATCHES, TPUT_PROMPT, equal_memory_offload_gb

MODELS = {"qwen": ckpt.QWEN3_30B_SHAPES, "mixtral": ckpt.MIXTRAL_SMALL, "deep": ckpt.QWEN3_30B_DEEP,
          "qwen_fp8": ckpt.QWEN3_30B_SHAPES, **{m: S.MODELS[m] for m in ("full", "full_heat", "full_fp8")}}
QUANTIZED = {"qwen_fp8": ("qwen", ckpt_quant.FP8_BLOCK)}  # model -> (the bf16 model it quantizes, how)
# The full-depth models are the SGLang bench's: dummy weights (S.DUMMY), FP8 written alone (S.DIRECT), routing
# replayed (S.ROUTED)
# Every run's engine: the plugin; apply_model sends a function to the worker; the engine core in the ``LLM``'s process,
# so that ``generate`` hands it every prompt before its first step (a core in a process of its own starts on the
# prompts that have arrived, and a batch's make-up, so its greedy tokens, would follow timing).
ENGINE_ENV = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "VLLM_PLUGINS": "moepage",
              "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass(frozen=True)
class Run:
    name: str
    model: str  # key of MODELS
    impl: str  # "unpaged" | "moepage"
    k: int | None = None
    offload_gb: float = 0.0  # vLLM's --cpu-offload-gb (GiB), an unpaged run's alternative
    phases: tuple[str, ...] = ("batch", "sequential")
    group: str = "check"
    mem: float = 0.35  # --gpu-memory-utilization
    eager: bool = False  # --enforce-eager (no CUDA graphs)
    timeout: int = 300
    host_budget: str | None = None  # moepage's disk tier: host rows a layer (or bytes); its steps need eager
    compress: bool = False  # moepage's host (and disk) rows losslessly coded
    new_tokens: int = NEW_TOKENS  # per sequential request and throughput pass

    @property
    def estimate(self) -> int:
        """Seconds the run is expected to take (start with graph capture, phases, shutdown)."""
        layers = MODELS[self.model].layers
        deep = 5 * layers if layers > 4 else 0  # loading the layers and capturing their graphs (8 layers: 40 s)
        return 90 + deep + 10 * max(1, layers // 8) * len(self.phases)  # a step of more layers takes longer

    @property
    def reference(self) -> str:
        return f"{self.model}-unpaged{'-eager' if self.eager else ''}"


def _matrix() -> list[Run]:
    """``check``: Qwen3-MoE and Mixtral shapes and Qwen3-MoE in block FP8, unpaged and paged, captured decode and
    eager; ``deep``: the
    throughput table (unpaged, moepage at K = E/4, vLLM's offload of the other experts' bytes)."""
    q, m = MODELS["qwen"], MODELS["mixtral"]
    runs = []
    for model, k in (("qwen", q.experts // 4), ("mixtral", m.experts // 4), ("qwen_fp8", q.experts // 4)):
        runs += [Run(f"{model}-unpaged", model, "unpaged"), Run(f"{model}-moepage-k{k}", model, "moepage", k)]
    # eager: the disk tier's references (tokens, and decode host-only)
    eager = dict(eager=True, phases=("batch", "sequential", "tput"))
    runs += [Run("qwen-unpaged-eager", "qwen", "unpaged", **eager),
             Run(f"qwen-moepage-k{q.experts // 4}-eager", "qwen", "moepage", q.experts // 4, **eager)]
    deep = MODELS["deep"]
    k = deep.experts // 4
    tput = dict(phases=("batch", "tput"), group="deep", timeout=480)
    runs += [Run("deep-unpaged", "deep", "unpaged", **tput), Run(f"deep-moepage-k{k}", "deep", "moepage", k, **tput)]
    gb = equal_memory_offload_gb(deep, k)
    runs.append(Run(f"deep-offload{gb}g", "deep", "unpaged", offload_gb=float(gb), **tput))
    # the disk tier: half the experts in host memory, the rest on disk (host-planned steps: eager); its tokens against
    # the eager unpaged run's, its decode against the host-only eager run's (check's eager pair)
    kq, half = q.experts // 4, q.experts // 2
    disk = dict(eager=True, group="disk", phases=("batch", "sequential", "tput"), timeout=420)
    runs += [Run(f"qwen-moepage-k{kq}-disk{half}", "qwen", "moepage", kq, host_budget=str(half), **disk),
             Run(f"qwen-moepage-k{kq}-disk{half}-coded", "qwen", "moepage", kq, host_budget=str(half), compress=True,
                 **disk)]
    return runs + _full()


def _full() -> list[Run]:
    """The SGLang bench's full-depth runs (``sglang_runs._full``: 48 layers, the same K, offloads and mem fractions)
    on vLLM: ``full`` (uniform routing) and ``full_heat`` (Qwen3-30B's, replayed) with dummy weights, ``full_fp8`` from
    a block-FP8 checkpoint; unpaged, moepage and vLLM's offload at equal GPU memory."""
    runs = []
    for r in (S.RUNS[n] for g in ("full", "full_heat", "full_fp8") for n in S.GROUPS[g]):
        if r.impl != "builtin":  # vLLM has no paged experts of its own
            runs.append(Run(r.name, r.model, r.impl, r.k, offload_gb=float(r.offload_gb), phases=r.phases,
                            group=r.group, mem=r.mem, timeout=r.timeout, new_tokens=r.new_tokens))
    return runs


RUNS, GROUPS = matrix.index(_matrix())


def select(only: str | None) -> list[Run]:
    return matrix.select(only, RUNS, GROUPS)


def spill_dir(run: Run, out: Path) -> Path:
    """Where a disk-tier run keeps its rows (and the disk's read speed is measured)."""
    return out / "spill" / run.name


def llm_kwargs(run: Run, model_path: str, out: Path = Path("/tmp")) -> dict:
    """``vllm.LLM`` arguments of ``run`` (names checked against vLLM 0.33.0's ``EngineArgs``)."""
    spec = MODELS[run.model]
    kw = dict(model=model_path, skip_tokenizer_init=True, gpu_memory_utilization=run.mem,
              max_model_len=spec.context, max_num_seqs=64, seed=0, enable_prefix_caching=False,
              attention_backend="TRITON_ATTN", moe_backend="triton", enforce_eager=run.eager, disable_log_stats=True)
    if run.impl == "moepage":
        chosen = {"num_resident": run.k}
        if run.host_budget is not None:
            chosen.update(host_budget=run.host_budget, spill_dir=str(spill_dir(run, out)))
        if run.compress:
            chosen["compress"] = True
        kw["additional_config"] = {"moepage": chosen}
    if run.offload_gb:
        kw["cpu_offload_gb"] = run.offload_gb
    if run.model in S.DUMMY:
        kw["load_format"] = "dummy"
    return kw


def checkpoint_of(model: str) -> str:
    """The checkpoint folder (under --ckpt-dir) a run of ``model`` loads."""
    return S.checkpoint_of(model)


def write_checkpoints(runs: list[Run], ckpt_dir: Path) -> None:
    """What ``runs`` load: bf16 checkpoints (a quantized twin beside its bf16 base), the FP8 one written alone, the
    dummy weights' configs."""
    for model in dict.fromkeys(checkpoint_of(r.model) for r in runs):
        if model in S.DUMMY:
            ckpt.write_config(MODELS[model], ckpt_dir / model)
            continue
        base, quant = QUANTIZED.get(model, (model, None))
        if model in S.DIRECT:
            took = ckpt.write_checkpoints(MODELS[model], ckpt_dir / model, quant=S.DIRECT[model])
        else:
            twin = {} if quant is None else {ckpt_dir / model: quant}
            took = ckpt.write_checkpoints(MODELS[base], ckpt_dir / base, twin)
        for path, s in took.items():
            print(f"wrote {path} in {s:.1f} s", flush=True)


def child_env(run: Run, out: Path) -> dict:
    """A run's environment: the engine's (``ENGINE_ENV``), replaying its model's routing where it has one."""
    env = {k: v for k, v in os.environ.items() if k != route_replay.ROUTE_ENV}
    env.update(ENGINE_ENV)
    table = S.route_table(run, out)
    return env if table is None else route_replay.child_env(table, env)


def paged_layers(model) -> dict:
    """In vLLM's worker (``LLM.apply_model``): each paged layer's E, K and counters."""
    from moepage.integrations.vllm import stats
    from moepage.integrations.vllm.method import paged_methods

    counts = stats(model).as_dict()["layers"]
    return {m.layer_key: {**counts.get(m.layer_key, {}), "num_experts": m.num_experts, "num_slots": m.num_slots}
            for m in paged_methods(model)}


def _layers(llm) -> dict:
    per_worker = llm.apply_model(paged_layers)
    return per_worker[0] if per_worker else {}


def _total(layers: dict, key: str) -> float:
    return sum(v.get(key, 0) for v in layers.values())


def run_child(run: Run, out: Path, ckpt_dir: Path) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    result = dict(run=run.name, spec=asdict(run), status="started", phases={})
    path = out / f"{run.name}.json"

    def save(status: str | None = None) -> None:
        result["status"] = status or result["status"]
        path.with_suffix(".tmp").write_text(json.dumps(result))
        os.replace(path.with_suffix(".tmp"), path)

    def greedy(n: int):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def generate(batch, news) -> list[list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], [greedy(n) for n in news],
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    spec = MODELS[run.model]
    kw = llm_kwargs(run, str(ckpt_dir / checkpoint_of(run.model)), out)
    result["llm_kwargs"] = kw
    save()
    t0, llm = time.perf_counter(), None
    try:
        llm = LLM(**kw)
        result["load_s"] = time.perf_counter() - t0
        layers = _layers(llm)
        result["layers"] = {k: {n: v[n] for n in ("num_experts", "num_slots")} for k, v in layers.items()}
        if (run.impl == "moepage") != bool(layers):
            raise RuntimeError(f"{run.impl} run, but {len(layers)} layers are paged by moepage in vLLM's worker")
        base = prompts(spec.vocab, CORRECTNESS_LENGTHS, seed=1)
        for phase in run.phases:
            t = time.perf_counter()
            if phase == "batch":  # twice: the second shows whether the engine repeats itself
                got = dict(outputs=generate(base, BATCH_NEW_TOKENS), outputs_b=generate(base, BATCH_NEW_TOKENS))
            elif phase == "sequential":
                got = dict(outputs=[generate([p], [run.new_tokens])[0] for p in base])
            elif phase == "tput":
                got = dict(batches={str(b): _throughput(b, generate, (lambda: _layers(llm)) if layers else None, run)
                                    for b in TPUT_BATCHES})
            else:
                raise ValueError(phase)
            got["seconds"] = time.perf_counter() - t
            result["phases"][phase] = got
            save()
    except BaseException:
        result["error"] = traceback.format_exc()
        save("failed")
        raise
    finally:
        if llm is not None:
            del llm
    result.update(_machine_figures(run, out))
    save("ok")


def _machine_figures(run: Run, out: Path) -> dict:
    """After the engine is down: the link's (and a disk tier's disk's) speed."""
    try:
        from bench.common import disk_read_gbs, memcpy_gbs

        figures = {"disk_gbs": disk_read_gbs(spill_dir(run, out))} if run.host_budget is not None else {}
        return {**figures, "memcpy_gbs": memcpy_gbs()}
    except Exception as exc:  # the report then has no link figure for this run
        return {"memcpy_error": repr(exc)}


def _throughput(b: int, generate, layers, run: Run) -> dict:
    """Decode tok/s of a batch of ``b`` prompts (a warm-up, the prefill alone, then the whole generation), with what
    the paged layers moved meanwhile (``layers()``: their counters; None unpaged)."""
    batch = prompts(MODELS[run.model].vocab, [TPUT_PROMPT] * b, seed=100 + b)
    generate(batch, [2] * b)  # warm-up
    t1 = time.perf_counter()
    generate(batch, [1] * b)
    prefill_s = time.perf_counter() - t1
    before = layers() if layers else {}
    t1 = time.perf_counter()
    new = sum(map(len, generate(batch, [run.new_tokens] * b)))
    total_s = time.perf_counter() - t1
    after = layers() if layers else {}
    moved = {key: _total(after, key) - _total(before, key)
             for key in ("misses", "bytes_paged", "disk_bytes", "host_misses")} if layers else {}
    return dict(batch=b, new_tokens=new, prefill_s=prefill_s, total_s=total_s,
                decode_tok_s=(new - b) / max(total_s - prefill_s, 1e-9), misses=moved.get("misses"), moved=moved)


# -- the report -----------------------------------------------------------------------------------------------------
def _equal(a: list | None, b: list | None) -> str:
    if a is None or b is None:
        return "–"
    return f"{sum(x == y for x, y in zip(a, b))}/{max(len(a), len(b))}"


def report(out: Path) -> str:
    """REPORT.md in ``out``: each run's outputs against its unpaged reference, and decode tokens/s with the ratios
    to unpaged and to the offload run of the same model. Returns its text."""
    results = {p.stem: json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json"))}
    check, speed = [], []
    for name, r in results.items():
        spec = Run(**{**r["spec"], "phases": tuple(r["spec"]["phases"])})
        ref = results.get(spec.reference, {}).get("phases", {})
        phases = r.get("phases", {})

        def outputs(where: dict, phase: str, key: str = "outputs"):
            return (where.get(phase) or {}).get(key)

        check.append(dict(run=name, status=r.get("status"), K=spec.k or "–", load_s=r.get("load_s"),
                          batch=_equal(outputs(ref, "batch"), outputs(phases, "batch")),
                          sequential=_equal(outputs(ref, "sequential"), outputs(phases, "sequential")),
                          batch_twice=_equal(outputs(phases, "batch"), outputs(phases, "batch", "outputs_b"))))
        offload = next((o for o, x in results.items() if x["spec"].get("offload_gb") and x["spec"]["model"] ==
                        spec.model), None)
        for b, tp in ((phases.get("tput") or {}).get("batches") or {}).items():
            row = dict(run=name, batch=int(b), decode_tok_s=tp["decode_tok_s"], misses=tp.get("misses"))
            host_only = f"{spec.model}-moepage-k{spec.k}{'-eager' if spec.eager else ''}" if spec.host_budget else None
            for label, other in (("vs_unpaged", spec.reference), ("vs_offload", offload), ("vs_host_only", host_only)):
                theirs = (((results.get(other) or {}).get("phases") or {}).get("tput") or {}).get("batches", {})
                if other != name and b in theirs:
                    row[label] = tp["decode_tok_s"] / theirs[b]["decode_tok_s"]
            speed.append(row)
    text = ("## vLLM engine: moepage vs unpaged vs --cpu-offload-gb (bench/serving/vllm_engine.py)\n\n"
            "### Greedy token ids against the unpaged engine\n\n" + table(check) + "\n### Decode\n\n" + table(speed))
    (Path(out) / "REPORT.md").write_text(text)
    return text


def unavailable() -> str | None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (see bench/gpu_vllm/README.md)"
    import torch

    return None if torch.cuda.is_available() else "no CUDA device"


def main(argv=None) -> int:
    args = matrix.parser(__doc__, "/tmp/moepage_vllm_bench").parse_args(argv)
    if matrix.answered(args, RUNS, GROUPS, run_child, report, unavailable,
                       "bench.serving.vllm_engine needs a CUDA GPU with vLLM"):
        return 0
    runs = select(args.only)
    write_checkpoints(runs, args.ckpt_dir)
    S.write_routes(runs, args.out)
    matrix.run_all(runs, args.out, args.budget, args.force,
                   lambda run, left: matrix.launch(run, args.out, args.ckpt_dir, min(run.timeout, left),
                                                   child_env(run, args.out), "bench.serving.vllm_engine"))
    print(report(args.out))
    return 0

if __name__ == "__main__":
    sys.exit(main())
