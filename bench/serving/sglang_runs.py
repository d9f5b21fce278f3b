"""What the SGLang engine benchmark (``sglang_engine.py``) runs: the models, the run matrix and its groups, and each
run's engine arguments and environment. ``--list`` prints the groups."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from bench.serving import ckpt_quant, matrix, route_replay, sglang_report
from bench.serving import sglang_ckpt as ckpt

# -- what runs ---------------------------------------------------------------------------------
QUANTIZED = {  # the bf16 "qwen" weights (gpt-oss's: "gptoss"), quantized so
    "qwen_fp8": ckpt_quant.FP8_BLOCK, "qwen_ctfp8": ckpt_quant.CT_FP8, "qwen_w8a8fp8": ckpt_quant.W8A8_FP8,
    "qwen_w8a8int8": ckpt_quant.W8A8_INT8, "qwen_gptq4": ckpt_quant.GPTQ_INT4, "qwen_gptq8": ckpt_quant.GPTQ_INT8,
    "qwen_awq4": ckpt_quant.AWQ_INT4, "qwen_ctw4a16": ckpt_quant.CT_W4A16, "gptoss_mxfp4": ckpt_quant.MXFP4}
MARLIN = {"qwen_gptq4": "gptq", "qwen_awq4": "awq", "qwen_ctw4a16": "ctw4a16", "gptoss_mxfp4": "mxfp4",
          "qwen_gptq8": "gptq8"}  # group
BASE = {"gptoss_mxfp4": "gptoss"}  # the bf16 checkpoint a quantized twin is written beside (else "qwen")
MODELS = {"qwen": ckpt.QWEN3_30B_SHAPES, "mixtral": ckpt.MIXTRAL_SMALL, "gptoss": ckpt.GPT_OSS_QWEN_SHAPES,
          "qwen64": ckpt.QWEN3_E64, "deep": ckpt.QWEN3_30B_DEEP, "full": ckpt.QWEN3_30B_FULL,
          "full_fp8": ckpt.QWEN3_30B_FULL}
MODELS.update({m: MODELS[BASE.get(m, "qwen")] for m in QUANTIZED})
DIRECT = {"full_fp8": ckpt_quant.FP8_BLOCK}  # checkpoints written in their format alone (no bf16 base on disk)
# Models served with the engines' dummy weights (``load_format="dummy"``): their folder holds the config only
DUMMY = ("full", "full_heat")
# A routed model loads another's checkpoint and replays a trace's routing in the engine (route_replay): its runs
# compare with its own unpaged run. The full-depth models always replay one: dummy weights route by noise (and their
# decode repeats a token, so its routing barely changes), and the FP8 one routes as they do for a like comparison.
ROUTED = {"deep_heat": ("deep", "qwen3-heat"),  # model -> (the checkpoint it loads, the trace it replays)
          "full": ("full", "uniform"), "full_heat": ("full", "qwen3-heat"), "full_fp8": ("full_fp8", "uniform")}
MODELS.update({m: MODELS[base] for m, (base, _) in ROUTED.items()})
ALL_PHASES = ("batch", "sequential", "concurrent", "tput")
DECODE_BS = [1, 2, 4, 8, 16, 32]
PREFILL_BS = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]  # prefill graph buckets (tokens)
TPUT_BATCHES = (1, 8, 32)
TPUT_PROMPT, NEW_TOKENS = 128, 64
# The full-depth runs: K such that every layer's slots hold about this many bytes of experts (a 24 GB-class card's
# share), and 32 new tokens a throughput pass (a paged step of 48 layers takes long; 32 steps give the mean)
FULL_EXPERT_GPU_BYTES = 16 * 10**9
FULL_NEW_TOKENS = 32


@dataclass(frozen=True)
class Run:
    name: str
    model: str  # key of MODELS
    impl: str  # "unpaged" | "moepage" | "builtin"
    k: int | str | None = None  # resident experts per layer, or "auto"
    prefill: str = "breakable"  # prefill CUDA graph backend: "breakable" | "disabled"
    decode: str = "full"  # decode CUDA graph backend: "full" | "disabled"
    mem: float = 0.35  # mem_fraction_static
    phases: tuple[str, ...] = ALL_PHASES
    tput_batches: tuple[int, ...] = TPUT_BATCHES
    group: str = "core"
    timeout: int = 240  # seconds for the whole child
    compress: bool = False  # moepage's host rows losslessly coded (--paged-experts-compress)
    deterministic: bool = False  # --enable-deterministic-inference
    policy: str | None = None  # moepage's policy, MOEPAGE_POLICY (None: its default)
    offload_gb: int = 0  # SGLang's whole-parameter offload (--cpu-offload-gb), an unpaged run's alternative
    host_budget: str | None = None  # moepage's disk tier: host rows a layer (or bytes), MOEPAGE_HOST_BUDGET
    new_tokens: int = NEW_TOKENS  # per sequential request and throughput pass (a disk tier's steps wait on reads)
    warm: bool = False  # a disk tier's host tier starts with the replayed trace's most routed experts
    restart_of: str | None = None  # a disk-tier run started again over the spill folder that run kept (a restart)

    @property
    def estimate(self) -> int:
        """Seconds a run is expected to take (engine start, phases, shutdown): no run starts
        with less than this left of the budget."""
        # coding the host rows at load delays the engine's start (bench/RESULTS.md, 'SGLang engine per format')
        coding = 90 if self.compress else 0
        layers = MODELS[self.model].layers
        deep = 7.5 * layers if layers > 4 else 0  # loading the layers and capturing their graphs (8 layers: 60 s)
        scale = max(1, layers // 8)  # a step of more layers (paged or offloaded: more bytes moved) takes longer
        tput = 5 * len(self.tput_batches) if "tput" in self.phases else 0
        return round(45 + coding + deep + scale * (6 * len(self.phases) + tput))

    @property
    def reference(self) -> str:
        """The unpaged run whose tokens this run must reproduce."""
        return sglang_report.reference_of(self.model, self.prefill, self.decode, self.deterministic)


def _matrix() -> list[Run]:
    """Every run, in priority order. Groups: ``core`` (bf16 Qwen, breakable prefill graph: every
    phase), ``auto`` (K from the GPU budget at mem_fraction_static 0.5 and 0.8; a 32-request run),
    ``nopg`` (prefill graphs disabled), ``fp8`` (block FP8), ``ctfp8`` (compressed-tensors FP8 per channel),
    ``w8a8`` (SGLang's W8A8 FP8 and INT8), ``gptq``, ``gptq8``, ``awq``, ``ctw4a16`` (grouped int4 and int8) and
    ``mxfp4`` (gpt-oss's architecture with MXFP4 experts) on Marlin (run them after the Marlin builds, which SGLang's
    JIT cache keeps), ``nograph`` (GPTQ without CUDA graphs), ``mixtral``, ``extra`` (the built-in where the matrix
    has room), ``compress`` (moepage with coded host rows, beside the raw rows' runs)."""
    q, m = MODELS["qwen"], MODELS["mixtral"]
    k25, k50, mk = q.experts // 4, q.experts // 2, m.experts // 4
    runs = [Run("qwen-unpaged", "qwen", "unpaged")]
    for k in (k25, k50):
        runs += [Run(f"qwen-moepage-k{k}", "qwen", "moepage", k), Run(f"qwen-builtin-k{k}", "qwen", "builtin", k)]
    auto = dict(phases=("batch", "tput"), tput_batches=(32,), group="auto")
    runs += [Run("qwen-moepage-auto-m50", "qwen", "moepage", "auto", mem=0.5, **auto),
             Run("qwen-moepage-auto-m80", "qwen", "moepage", "auto", mem=0.8, **auto)]
    correctness = ("batch", "sequential", "concurrent")
    nopg = dict(prefill="disabled", phases=correctness, group="nopg")
    runs += [Run("qwen-unpaged-nopg", "qwen", "unpaged", **nopg),
             Run(f"qwen-moepage-k{k25}-nopg", "qwen", "moepage", k25, **nopg)]
    for model, group in (("qwen_fp8", "fp8"), ("qwen_ctfp8", "ctfp8"), ("qwen_w8a8fp8", "w8a8"),
                         ("qwen_w8a8int8", "w8a8")):  # the quantized twins of "qwen"
        quant = dict(phases=("batch", "sequential", "tput"), group=group)
        runs += [Run(f"{model}-unpaged", model, "unpaged", **quant),
                 Run(f"{model}-moepage-k{k25}", model, "moepage", k25, **quant),
                 Run(f"{model}-builtin-k{k25}", model, "builtin", k25, **quant)]
    # Marlin, with CUDA graphs; the engine's start builds SGLang's Marlin MoE kernel unless its JIT cache has it
    for model, group in MARLIN.items():
        marlin = dict(phases=("batch", "sequential", "tput"), group=group, timeout=420)
        runs += [Run(f"{model}-unpaged", model, "unpaged", **marlin),
                 Run(f"{model}-moepage-k{k25}", model, "moepage", k25, **marlin),
                 Run(f"{model}-builtin-k{k25}", model, "builtin", k25, **marlin)]
    # GPTQ without CUDA graphs, as Marlin formats were served before their waves ran on the slot table
    nograph = dict(phases=("batch", "sequential", "tput"), group="nograph", prefill="disabled", decode="disabled",
                   timeout=420)
    runs += [Run(f"qwen_gptq4-{impl}{'' if k is None else f'-k{k}'}-nograph", "qwen_gptq4", impl, k, **nograph)
             for impl, k in (("unpaged", None), ("moepage", k25), ("builtin", k25))]
    mix = dict(phases=correctness, group="mixtral", timeout=180)
    runs += [Run("mixtral-unpaged", "mixtral", "unpaged", **mix),
             Run(f"mixtral-moepage-k{mk}", "mixtral", "moepage", mk, **mix)]
    runs += [Run(f"qwen-builtin-k{k25}-nopg", "qwen", "builtin", k25, **{**nopg, "group": "extra"}),
             Run(f"mixtral-builtin-k{mk}", "mixtral", "builtin", mk, **{**mix, "group": "extra"})]
    coded = dict(phases=("batch", "sequential", "tput"), group="compress", compress=True, timeout=330)
    runs += [Run(f"qwen-moepage-k{k}-coded", "qwen", "moepage", k, **coded) for k in (k25, k50)]
    # Staggered concurrent arrivals (prompts joining while others decode), twice per engine: unpaged against itself
    # shows the engine's own run-to-run noise; with --enable-deterministic-inference paged must equal unpaged.
    # (mixtral's unpaged reference without it is the mixtral group's run: --only arrivals,mixtral-unpaged)
    arrivals = dict(phases=("concurrent",), group="arrivals", timeout=200)
    for model, k in (("mixtral", mk * 2), ("qwen64", MODELS["qwen64"].experts // 8)):
        for det in (False, True):
            tag = "-det" if det else ""
            if not (model == "mixtral" and not det):
                runs.append(Run(f"{model}-unpaged{tag}", model, "unpaged", deterministic=det, **arrivals))
            runs.append(Run(f"{model}-moepage-k{k}{tag}", model, "moepage", k, deterministic=det, **arrivals))
    runs += _deep()
    runs += _full()
    return runs


def equal_memory_offload_gb(spec: ckpt.ModelSpec, k: int, expert_bytes: int | None = None) -> int:
    """--cpu-offload-gb (GiB) leaving on the GPU what K slots a layer hold: the other E - K experts' bytes (bf16, or
    ``expert_bytes`` each)."""
    return round(spec.layers * (spec.experts - k) * (expert_bytes or spec.expert_bytes) / 2**30)


def full_resident(spec: ckpt.ModelSpec, expert_bytes: int, gpu_bytes: int = FULL_EXPERT_GPU_BYTES) -> int:
    """K whose slots, over every layer of ``spec``, hold about ``gpu_bytes`` of experts of ``expert_bytes`` each."""
    return gpu_bytes // (spec.layers * expert_bytes)


# The unpaged full-depth runs' mem_fraction_static (vLLM: --gpu-memory-utilization): 48 layers of bf16 experts are
# 58 GB (the attention 2 GB more), which an 80 GB H100 holds with room for a KV cache only with the static pool high:
# 0.85 (68 GB, about 8 GB of it KV cache); the FP8 ones, 29 GB. The paged and offloaded runs keep about 18 GB on the
# GPU: the default 0.35 holds it on either card.
FULL_UNPAGED_MEM = {"full": 0.85, "full_heat": 0.85, "full_fp8": 0.5}


def _full() -> list[Run]:
    """Every layer of Qwen3-30B-A3B (48), K such that the experts on the GPU take about 16 GB: decode tokens/s at batch
    1 / 8 / 32 and start-up. ``full`` (uniform routing) and ``full_heat`` (Qwen3-30B's routing, replayed) with dummy
    weights: unpaged, moepage, SGLang's offload at equal GPU memory (SGLang's built-in refuses dummy weights);
    ``full_profile``: where a decode step's GPU time goes; ``full_fp8``: a block-FP8 checkpoint read from disk, with the
    built-in at equal K too."""
    spec = MODELS["full"]
    k = full_resident(spec, spec.expert_bytes)
    gb = equal_memory_offload_gb(spec, k)
    tput = dict(phases=("tput",), new_tokens=FULL_NEW_TOKENS, timeout=900)  # dummy weights' tokens tell nothing
    runs = []
    for model in ("full", "full_heat"):
        runs += [Run(f"{model}-unpaged", model, "unpaged", mem=FULL_UNPAGED_MEM[model], group=model, **tput),
                 Run(f"{model}-moepage-k{k}", model, "moepage", k, group=model, **tput),
                 Run(f"{model}-offload{gb}g", model, "unpaged", offload_gb=gb, group=model, **tput)]
    prof = dict(group="full_profile", phases=("profile",), timeout=900)
    runs += [Run("full-unpaged-profile", "full", "unpaged", mem=FULL_UNPAGED_MEM["full"], **prof),
             Run(f"full-moepage-k{k}-profile", "full", "moepage", k, **prof)]
    fp8 = spec.stored_expert_bytes(DIRECT["full_fp8"])
    k8, gb8 = full_resident(spec, fp8), equal_memory_offload_gb(spec, full_resident(spec, fp8), fp8)
    fp = dict(group="full_fp8", **tput)
    runs += [Run("full_fp8-unpaged", "full_fp8", "unpaged", mem=FULL_UNPAGED_MEM["full_fp8"], **fp),
             Run(f"full_fp8-moepage-k{k8}", "full_fp8", "moepage", k8, **fp),
             Run(f"full_fp8-builtin-k{k8}", "full_fp8", "builtin", k8, **fp),
             Run(f"full_fp8-offload{gb8}g", "full_fp8", "unpaged", offload_gb=gb8, **fp)]
    return runs


def _deep() -> list[Run]:
    """The claim table, side by side, on 8 layers of Qwen3-30B-A3B expert shapes (a call's budget holds one group):
    ``deep`` (uniform routing: unpaged, moepage, the built-in, SGLang's whole-parameter offload at equal GPU memory),
    ``deep_coded`` (moepage with coded host rows: decode and start-up beside ``deep``'s raw rows), ``profile`` (where
    a decode step's GPU time goes, ``step_profile``) and ``deep_heat``
    (a trace's routing replayed: unpaged, the built-in, moepage under three policies) and ``disk`` (moepage's disk
    tier, half the experts in host memory, on both routings, and on the trace's with the host tier warmed from it;
    the host-only runs are ``deep``'s and ``deep_heat``'s; with coded rows too, and each started again over the folder
    it kept: the start-up a restart takes)."""
    spec = MODELS["deep"]
    k = spec.experts // 4
    tput = dict(phases=("batch", "tput"), timeout=420)
    runs = [Run("deep-unpaged", "deep", "unpaged", group="deep", **tput),
            Run(f"deep-moepage-k{k}", "deep", "moepage", k, group="deep", **tput),
            Run(f"deep-builtin-k{k}", "deep", "builtin", k, group="deep", **tput)]
    gb = equal_memory_offload_gb(spec, k)
    runs += [Run(f"deep-offload{gb}g", "deep", "unpaged", offload_gb=gb, group="deep", **tput),
             Run(f"deep-moepage-k{k}-coded", "deep", "moepage", k, compress=True, group="deep_coded", **tput)]
    heat = dict(group="deep_heat", **tput)
    runs += [Run("deep_heat-unpaged", "deep_heat", "unpaged", **heat),
             Run(f"deep_heat-builtin-k{k}", "deep_heat", "builtin", k, **heat),
             Run(f"deep_heat-moepage-k{k}", "deep_heat", "moepage", k, **heat)]
    runs += [Run(f"deep_heat-moepage-k{k}-{policy}", "deep_heat", "moepage", k, policy=policy, **heat)
             for policy in ("lru", "lfru")]
    # where a decode step's GPU time goes, engine by engine (a profiler slows the steps it records: no tok/s here)
    prof = dict(group="profile", phases=("profile",))
    runs += [Run("deep-unpaged-profile", "deep", "unpaged", **prof),
             Run(f"deep-moepage-k{k}-profile", "deep", "moepage", k, **prof),
             Run(f"deep-builtin-k{k}-profile", "deep", "builtin", k, **prof)]
    # the disk tier: half the experts in host memory, the rest on disk; decode eager (SGLang's breakable decode graph
    # cannot serve a model), as its token reference and its host-only twin are
    half = spec.experts // 2
    eager = dict(group="disk", decode="disabled", timeout=600, phases=("batch", "sequential", "tput"), new_tokens=16)
    for model in ("deep", "deep_heat"):
        runs += [Run(f"{model}-unpaged-eagerdecode", model, "unpaged", **eager),
                 Run(f"{model}-moepage-k{k}-eagerdecode", model, "moepage", k, **eager)]
    disk = dict(eager, host_budget=str(half))
    raw, coded = (Run(f"deep-moepage-k{k}-disk{half}", "deep", "moepage", k, **disk),
                  Run(f"deep-moepage-k{k}-disk{half}-coded", "deep", "moepage", k, compress=True, **disk))
    runs += [raw, Run(f"deep_heat-moepage-k{k}-disk{half}", "deep_heat", "moepage", k, **disk),
             Run(f"deep_heat-moepage-k{k}-disk{half}-warm", "deep_heat", "moepage", k, warm=True, **disk), coded]
    runs += [replace(r, name=f"{r.name}-restart", restart_of=r.name, phases=("batch",), timeout=300)
             for r in (raw, coded)]  # started again over the rows each kept: a restart's start-up
    return runs


def quantization(model: str) -> ckpt_quant.Quantization | None:
    """How ``model``'s checkpoint is quantized (None: bf16)."""
    return QUANTIZED.get(model) or DIRECT.get(model)


def checkpoint_of(model: str) -> str:
    """The checkpoint folder (under --ckpt-dir) a run of ``model`` loads."""
    return ROUTED[model][0] if model in ROUTED else model


RUNS, GROUPS = matrix.index(_matrix())


def select(only: str | None) -> list[Run]:
    """The runs named by ``--only`` (run names or group names, comma-separated), in matrix order."""
    return matrix.select(only, RUNS, GROUPS)


def engine_kwargs(run: Run, model_path: str) -> dict:
    """``sglang.Engine`` arguments of ``run`` (names checked against sglang 0.5.23's ServerArgs)."""
    spec = MODELS[run.model]
    kw = dict(
        model_path=model_path, skip_tokenizer_init=True, attention_backend="triton", sampling_backend="pytorch",
        disable_shared_experts_fusion=True, log_level="info" if run.k == "auto" else "error",
        mem_fraction_static=run.mem, context_length=spec.context, chunked_prefill_size=4096,
        max_running_requests=64, disable_radix_cache=True, random_seed=0,
        moe_runner_backend=quantization(run.model).runner if quantization(run.model) else "triton",
        cuda_graph_backend_decode=run.decode, cuda_graph_backend_prefill=run.prefill,
    )
    if run.decode in ("full", "breakable"):
        kw.update(cuda_graph_bs_decode=list(DECODE_BS), cuda_graph_max_bs_decode=max(DECODE_BS))
    if run.prefill == "breakable":
        kw.update(cuda_graph_bs_prefill=list(PREFILL_BS), cuda_graph_max_bs_prefill=max(PREFILL_BS))
    if run.model.endswith("fp8"):
        kw["fp8_gemm_runner_backend"] = "triton"
    if run.model in DUMMY:
        kw["load_format"] = "dummy"
    if run.impl != "unpaged":
        kw.update(enable_paged_experts=True, paged_experts_num_resident=run.k)
    if run.deterministic:
        kw["enable_deterministic_inference"] = True
    if run.offload_gb:
        kw["cpu_offload_gb"] = run.offload_gb
    return kw


CHILD_VARS = ("MOEPAGE_SGLANG_IMPL", "MOEPAGE_STATS_PATH", "MOEPAGE_COMPRESS", "MOEPAGE_POLICY", "MOEPAGE_HOST_BUDGET",
              "MOEPAGE_SPILL_DIR", "MOEPAGE_HOST_WARM", route_replay.ROUTE_ENV)  # set per run, never inherited


def child_env(run: Run, out: Path) -> dict:
    """The child's environment: which paged-experts implementation, where the stats dump goes."""
    env = {k: v for k, v in os.environ.items() if k not in CHILD_VARS}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               MOEPAGE_STATS_PATH=str(out / "stats" / f"{run.name}.json"))
    if run.impl == "builtin":
        env["MOEPAGE_SGLANG_IMPL"] = "sglang"
    if run.compress:
        env["MOEPAGE_COMPRESS"] = "1"
    if run.policy is not None:
        env["MOEPAGE_POLICY"] = run.policy
    if run.host_budget is not None:
        env.update(MOEPAGE_HOST_BUDGET=run.host_budget, MOEPAGE_SPILL_DIR=str(spill_dir(run, out)))
    table = route_table(run, out)
    if run.warm:
        if table is None or run.host_budget is None:
            raise ValueError(f"run {run.name}: warm is for a disk tier over a replayed trace")
        env["MOEPAGE_HOST_WARM"] = str(warm_trace(run, out))
    return env if table is None else route_replay.child_env(table, env)


def spill_dir(run: Run, out: Path) -> Path:
    """Where a disk-tier run keeps its rows (and the disk's read speed is measured); a restart: its first run's."""
    return out / "spill" / (run.restart_of or run.name)


def route_table(run: Run, out: Path) -> Path | None:
    """The routing table a run of a routed model replays (``write_routes`` writes it), else None."""
    return out / "routes" / f"{run.model}.pt" if run.model in ROUTED else None


def warm_trace(run: Run, out: Path) -> Path:
    """The trace a warmed run's host tier starts from (``write_routes`` writes it beside the table)."""
    return out / "routes" / f"{run.model}-warm.npz"


def write_routes(runs: list[Run], out: Path) -> None:
    """The routing tables ``runs`` replay, each written once (and as a trace to warm a host tier from)."""
    for run in {r.model: r for r in runs if r.model in ROUTED}.values():
        spec, path = MODELS[run.model], route_table(run, out)
        route_replay.write_table(ROUTED[run.model][1], spec.layers, spec.experts, spec.top_k, path)
        route_replay.write_warm(path, warm_trace(run, out))
