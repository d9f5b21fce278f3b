"""Startup checks of moepage's vLLM plugin: every reason a launch or a layer cannot be paged, in one ``ConfigError``.
``launch_problems`` reads a ``Launch`` (what ``compat.launch`` reads of vLLM's config) when the engine's config is made
in the first process, and again where each worker builds its first MoE layer; ``layer_problems`` reads a ``Layer``
there; ``kernel_problems`` the kernel the base method built at post-load. Each refusal says why and what to do.
``SERVED_EXPERTS``: the expert kernels whose per-entry outputs the paged step merges before their own top-k sum."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...compress import refusal as compress_refusal
from ...config import Problems, environment_problems, parse_cpu_share, parse_prefetch
from ...errors import ConfigError
from ...residency import k_problem, resolve_policy
from ..fused import FusedLayout, fused_problem
from ..options import HOST_BUDGET, tier_problems
from .settings import OPTIONS, WHERE, named, setting

SERVED_METHODS = ("UnquantizedFusedMoEMethod", "Fp8MoEMethod")  # and their subclasses (a platform's own)
SERVED_QUANTIZATION = (None, "fp8")  # vLLM's --quantization (None: unquantized); FP8 block-quantized only
SERVED_EXPERTS = ("TritonExperts",)  # and their subclasses
UNQUANTIZED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Launch:
    """What the checks read of vLLM's engine configuration."""

    pipeline_parallel: int = 1
    data_parallel: int = 1
    eplb: bool = False
    redundant_experts: int = 0
    all2all: bool = False
    dbo: bool = False
    elastic_ep: bool = False
    context_parallel: int = 1  # prefill x decode context parallel
    lora: bool = False
    speculative: bool = False
    offload: str = ""  # which whole-parameter offload is on ("" none)
    load_format: str = "auto"
    quantization: str | None = None
    sleep_mode: bool = False
    architectures: tuple[str, ...] = ()
    checkpoint: str | None = None  # a local folder of the checkpoint's files (None: not on this machine yet)
    cuda_graphs: bool = False  # vLLM captures CUDA graphs (not --enforce-eager)


@dataclass(frozen=True)
class Layer:
    """What the checks read of one MoE layer as vLLM builds it."""

    name: str
    num_experts: int  # the router's E
    local_experts: int
    top_k: int
    method: str  # the class names of the base quant method and its bases
    dtype: torch.dtype  # the activations' (vLLM's params_dtype)
    own_quant_method: bool = False  # the layer's class chooses its own quant method (moepage's hook is not asked)
    fp8_scales: str | None = None  # FP8 experts: "block" (per-block weight scales, per-token-group activations), or
    # what else ("per-tensor static" / "per-tensor dynamic")
    fused: FusedLayout | None = None  # what its experts compute (the CPU's share of a split reads it)


REFUSED_LAUNCH = (  # (what is on, why paging refuses it, what to do)
    ("eplb", "EPLB moves and replicates physical experts between ranks from the layer's expert tensors",
     "drop --enable-eplb"),
    ("data_parallel", "the MoE layer then runs every data-parallel rank's tokens through a dispatch and combine",
     "serve with --data-parallel-size 1"),
    ("all2all", "an all-to-all backend dispatches tokens to experts on other ranks", "serve without --all2all-backend"),
    ("dbo", "dual-batch overlap interleaves two micro-batches inside the MoE kernel", "drop --enable-dbo"),
    ("elastic_ep", "elastic EP swaps quant methods and remaps experts while serving", "drop --enable-elastic-ep"),
    ("context_parallel", "context parallelism gathers tokens across ranks into the MoE layer",
     "serve with --prefill-context-parallel-size 1 and --decode-context-parallel-size 1"),
    ("pipeline_parallel", "not served yet: each stage would page only its own layers, which is not checked",
     "serve with --pipeline-parallel-size 1"),
    ("lora", "LoRA replaces the experts' quant method with its own kernel", "serve without --enable-lora"),
    ("speculative", "a draft or MTP model builds its own MoE layers and capture sizes, which are not checked",
     "serve without --speculative-config"),
    ("offload", "vLLM's offload would move the K-slot table itself to host memory (moepage pages the experts)",
     "serve without vLLM's --cpu-offload-gb / --offload-group-size"),
    ("sleep_mode", "sleep mode discards and restores GPU weights behind moepage's slot table",
     "serve without --enable-sleep-mode"),
)


# Model classes whose own weight loading writes the expert tensors directly, past the loaders moepage gives them.
REFUSED_ARCHITECTURES = {
    "GptOssForCausalLM": "vLLM's gpt-oss loader copies whole expert tensors into the layer's parameters, past the "
                         "loaders that fill moepage's host rows",
}


def _is_on(launch: Launch, field: str) -> bool:
    value = getattr(launch, field)
    if field in ("data_parallel", "pipeline_parallel", "context_parallel"):
        return value > 1
    return bool(value)


def launch_problems(launch: Launch, chosen: dict, problems: Problems) -> None:
    """What in the launch or moepage's options (``chosen``: ``settings.options``) paging cannot serve."""
    for field, why, fix in REFUSED_LAUNCH:
        if _is_on(launch, field):
            problems.add(f"{field.replace('_', ' ')}: {why}; {fix}")
    for arch in launch.architectures:
        if arch in REFUSED_ARCHITECTURES:
            problems.add(f"{arch}: {REFUSED_ARCHITECTURES[arch]}; serve it unpaged (or through the SGLang plugin)")
    if launch.redundant_experts:
        problems.add(f"redundant experts ({launch.redundant_experts}): EPLB's replicas are not paged; set "
                     "num_redundant_experts to 0")
    if launch.load_format == "dummy" and setting(chosen, "host_budget") is not None:
        problems.add(f"--load-format dummy with a disk tier ({HOST_BUDGET}): the tier lays out and keeps the "
                     "checkpoint's rows, and a dummy load has none; serve dummy weights without a disk tier, or load "
                     "the checkpoint")
    if launch.quantization not in SERVED_QUANTIZATION:
        problems.add(f"quantization {launch.quantization!r}: moepage's vLLM plugin serves unquantized and block-FP8 "
                     "(`fp8` with a weight_block_size) experts so far (other formats are not checked exact on vLLM's "
                     "kernels yet); serve one of those, or this format through the SGLang plugin")
    if chosen.get("num_resident") == "auto" and launch.checkpoint is None:
        problems.add(f"{OPTIONS['num_resident'].flag} auto sizes K from the checkpoint's safetensors headers, and the "
                     "checkpoint is not on this machine yet; download it first (`hf download MODEL --local-dir DIR`, "
                     "then serve DIR) or pass an integer K")
    _tier_problems(launch, chosen, problems)
    _option_problems(chosen, problems)
    if cpu_share(chosen, problems) is not None and launch.cuda_graphs:
        problems.add(f"{OPTIONS['cpu_share'].flag}: a split step is planned on the host, which vLLM's CUDA graphs "
                     "cannot replay (they run no Python, and capture the MoE layer in their pieces); serve with "
                     "--enforce-eager")


def cpu_share(chosen: dict, problems: Problems | None = None) -> float | str | None:
    """The CPU share asked for (None: off); an unreadable one is said to ``problems`` (and read as off)."""
    value = setting(chosen, "cpu_share")
    try:
        return parse_cpu_share(value)
    except ValueError as exc:
        if problems is not None:
            problems.add(f"{OPTIONS['cpu_share'].flag}: {value!r} is {exc}")
        return None


def _tier_problems(launch: Launch, chosen: dict, problems: Problems) -> None:
    """A disk tier: the options' shared rules (``options.tier_problems``), and eager steps (no CUDA graphs)."""
    budget = setting(chosen, "host_budget")
    for why in tier_problems(budget, setting(chosen, "spill_dir"), setting(chosen, "host_warm"),
                             named(chosen, "spill_dir")):
        problems.add(why)
    if budget is not None and launch.cuda_graphs:
        problems.add(f"{HOST_BUDGET}: a disk tier plans its steps on the host, which vLLM's CUDA graphs cannot replay "
                     "(they cannot wait on a disk); serve with --enforce-eager")


def _option_problems(chosen: dict, problems: Problems) -> None:
    environment_problems(problems)  # every MOEPAGE_* variable that is set, readable
    k = chosen.get("num_resident")
    if k == "auto":
        pass  # sized where each rank builds its first layer (``auto``), from the checkpoint ``launch_problems`` found
    elif isinstance(k, bool) or not isinstance(k, int) or k < 1:
        problems.add(f"{OPTIONS['num_resident'].flag} / num_resident: expected a positive integer, got {k!r}")
    policy = setting(chosen, "policy")
    if policy is not None:
        try:
            resolve_policy(policy)
        except (TypeError, ValueError) as exc:
            problems.add(f"{OPTIONS['policy'].flag}: {exc}")
    try:
        parse_prefetch(chosen.get("prefetch"))
    except ValueError as exc:
        problems.add(f"{OPTIONS['prefetch'].flag}: {exc}")


def layer_problems(layer: Layer, k: int | None, chosen: dict, problems: Problems) -> None:
    """What about one layer paging cannot serve (``k``: its K, None where it comes from a split file)."""
    if layer.own_quant_method:
        problems.add("this MoE layer's class picks its own quant method, which moepage's hook does not see; serve "
                     "this model unpaged", layer.name)
    if not any(m in SERVED_METHODS for m in layer.method.split()):
        problems.add(f"{layer.method.split()[0]} experts are not served yet: moepage's vLLM plugin serves "
                     "unquantized and block-FP8 experts so far", layer.name)
    elif layer.dtype not in UNQUANTIZED_DTYPES:
        problems.add(f"{layer.dtype} experts: served in {', '.join(map(str, UNQUANTIZED_DTYPES))}", layer.name)
    elif layer.fp8_scales not in (None, "block"):
        problems.add(f"FP8 experts with {layer.fp8_scales} scales: vLLM takes one activation scale over every expert "
                     "or over the whole batch, which a wave of the slot table cannot reproduce; serve block-quantized "
                     "FP8 (a weight_block_size) or unquantized experts", layer.name)
    # Under EP a rank pages its own experts, and a token routes at most all of them here.
    local = layer.local_experts
    if k is not None and (why := k_problem(k, local, min(layer.top_k, local), OPTIONS["num_resident"].flag)):
        problems.add(why, layer.name)
    if cpu_share(chosen) is not None and layer.fused is not None and (
            why := fused_problem(layer.fused, OPTIONS["cpu_share"].flag)):
        problems.add(why, layer.name)
    weights = torch.float8_e4m3fn if layer.fp8_scales else layer.dtype
    if setting(chosen, "compress") and (why := compress_refusal(weights)):
        problems.add(f"{OPTIONS['compress'].flag}: the experts are {weights}: {why}; serve without it", layer.name)


def kernel_problems(name: str, experts: str, monolithic: bool, reduces_apart: bool) -> None:
    """Refuse a kernel the paged step cannot run wave by wave (``experts``: the fused-experts class and its bases;
    ``reduces_apart``: its top-k sum is a separate ``moe_sum`` over per-entry outputs, the one moepage merges)."""
    problems = Problems()
    if monolithic:
        problems.add("vLLM picked a monolithic MoE kernel (routing, experts and sum in one call): nothing to page "
                     "into; pass --moe-backend triton", name)
    elif not any(e in SERVED_EXPERTS for e in experts.split()) or not reduces_apart:
        problems.add(f"vLLM's {experts.split()[0]} kernel is not served yet (moepage merges the per-entry outputs of "
                     f"{', '.join(SERVED_EXPERTS)} before their own top-k sum); pass --moe-backend triton", name)
    problems.raise_if_any(f"moepage: {WHERE}")


def check(launch: Launch, chosen: dict, layer: Layer | None = None, k: int | None = None) -> None:
    """Raise one ``ConfigError`` naming every problem of the launch (and ``layer``)."""
    problems = Problems()
    launch_problems(launch, chosen, problems)
    if layer is not None:
        layer_problems(layer, k, chosen, problems)
    problems.raise_if_any(f"moepage: {WHERE}: cannot page this launch")


__all__ = ["ConfigError", "Launch", "Layer", "check", "kernel_problems", "launch_problems", "layer_problems"]
