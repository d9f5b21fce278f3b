"""Startup checks: every reason the launch or a layer cannot be paged, in one ``ConfigError`` when the first
``FusedMoE`` layer is built. ``problems`` only reads SGLang's published configuration and the layer, so a rejected
launch fails before any weight is loaded. They are moepage's own, not ``check_paged_experts_compat``'s: K > E is
refused (not clamped), decode graphs capture every batch size (no cap at K // top_k), TP and EP over SGLang's standard
dispatch are served (``PARALLEL_REFUSED``: the layouts that are not), and policies, prefetch and splits are checked.
``SERVED``: the formats (class names) moepage serves; others are refused until checked exact."""

from __future__ import annotations

import torch

from ...compress import refusal as compress_refusal
from ...config import SGLANG, Problems, parse_cpu_share, parse_prefetch
from ...errors import ConfigError
from ...residency import k_problem, resolve_policy
from ..flags import OPTIONS
from ..fused import fused_problem
from ..options import HOST_BUDGET, tier_problems
from . import compat
from .settings import CPU_SHARE_WHERE, PREFETCH_WHERE, named, setting

RUNNER_BACKENDS = ("auto", "triton", "marlin")
# Formats exact on an H200 in tests/gpu/test_sglang_formats_gpu.py; the others are refused, with the reason REFUSED
# gives where one is known (else: not checked exact yet).
SERVED = ("UnquantizedFormat", "Fp8BlockFormat", "W8A8Fp8Format", "W8A8Int8Format", "CompressedTensorsFp8Format",
          "GptqFormat", "AwqFormat", "CompressedTensorsWNA16Format", "Mxfp4Format")
REFUSED = {
    "BlockInt8Format": "SGLang's Triton MoE kernel rounds block-INT8 products once per K tile, and picks the tile (32 "
                       "or 64) from the batch size against the layer's expert count: K slots in place of E experts "
                       "can pick another tile and round otherwise (an H200 run differed from unpaged in one step)",
    # Measured with the refusal lifted, against Marlin's own noise: the figures are in docs/formats.md.
    "ModelOptNvfp4Format": "on SGLang's Marlin runner its paged steps differed from unpaged beyond the runner's own "
                           "batch-to-batch noise when measured on an H200 (docs/formats.md)",
    "CompressedTensorsNvfp4Format": "on SGLang's Marlin runner its paged steps differed from unpaged beyond the "
                                    "runner's own batch-to-batch noise when measured on an H200 (docs/formats.md)",
}
BLOCKED = ("Fp8BlockFormat", "CompressedTensorsFp8Format")  # formats whose block size FP8_BLOCKS limits
# Block FP8 [16, 16] does not run in SGLang 0.5.23 at all on the H200: its Triton MoE kernel takes BLOCK_SIZE_K = the
# block's k side, and tl.dot needs K >= 32 (a compile error, paged or not). Other blocks are not checked.
FP8_BLOCKS = ([128, 128],)
# Formats whose method picks its runner, served on the runner checked exact (Marlin): the method's own choice is read
MARLIN_ONLY = ("Mxfp4Format",)
# Weight widths checked exact for formats that take several (others refused until checked)
CHECKED_BITS = {"CompressedTensorsWNA16Format": (4,)}
UNQUANTIZED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
RESIDENT = OPTIONS["num_resident"].flag  # SGLang's own flag
POLICY_WHERE, COMPRESS_WHERE = (OPTIONS[key].where(SGLANG) for key in ("policy", "compress"))


def prefetch_setting(value) -> bool | int:
    try:
        return parse_prefetch(value)
    except ValueError as exc:
        raise ConfigError(f"{PREFETCH_WHERE}: {exc}") from None


def _weight_block(layer, base_method) -> list[int] | None:
    """The FP8 block of the layer's experts: its compressed-tensors scheme's (the experts' own), else the quant
    config's (block FP8)."""
    for holder in (getattr(layer, "scheme", None), getattr(base_method, "quant_config", None)):
        block = getattr(holder, "weight_block_size", None)
        if block is not None:
            return list(block)
    return None


def _compress_problem(fmt, layer, store_name: str | None) -> str | None:
    """Why ``--paged-experts-compress`` cannot code this layer's rows (bf16 unquantized experts only, in a store that
    codes rows: ``store_name`` is None for one that does)."""
    if store_name is not None:
        return f"{COMPRESS_WHERE}: the {store_name} store keeps no coded rows (moepage's cuda and torch stores do)"
    if type(fmt).__name__ != "UnquantizedFormat":
        return (f"{COMPRESS_WHERE}: codes unquantized bfloat16 experts only; {fmt.label} experts are quantized already "
                "(nothing left in their exponents to code). Serve without it")
    dtype = getattr(layer, "params_dtype", None)
    if dtype is not None and (why := compress_refusal(dtype)):
        return f"{COMPRESS_WHERE}: the experts are {dtype}: {why}. Serve without it, or in bfloat16"
    return None


def _format_problem(fmt, layer, base_method) -> str | None:
    if fmt is None or type(fmt).__name__ not in SERVED:
        why = REFUSED.get(type(fmt).__name__, "not checked exact yet")
        what = ("no format of SGLang's paged experts" if fmt is None
                else f"{fmt.label} experts are not served by moepage ({why})")
        labels = ", ".join(f.label for f in compat.sglang_formats.FORMATS if f.__name__ in SERVED)
        return f"{type(layer.quant_method).__name__}: {what}; moepage serves {labels}"
    block = _weight_block(layer, base_method)
    if type(fmt).__name__ in BLOCKED and block is not None and list(block) not in FP8_BLOCKS:
        return (f"{fmt.label} experts with weight_block_size {list(block)}: moepage serves "
                f"{' or '.join(map(str, FP8_BLOCKS))} (DeepSeek's and Qwen3-FP8's, checked exact on an H200) only. "
                "SGLang's Triton MoE kernel cannot compile blocks whose k side is under 32 (its BLOCK_SIZE_K is that "
                "side; tl.dot needs 32); other blocks are not checked exact")
    if type(fmt).__name__ in MARLIN_ONLY and not compat.picked_marlin(base_method):
        return (f"{fmt.label} experts are served on SGLang's Marlin MoE runner only (checked exact on an H200), and "
                f"this launch's {type(base_method).__name__} runs another: pass --moe-runner-backend marlin")
    bits = getattr(getattr(layer, "scheme", None), "num_bits", None)
    if (checked := CHECKED_BITS.get(type(fmt).__name__)) and bits is not None and bits not in checked:
        return (f"{fmt.label} experts with {bits}-bit weights: moepage serves {' or '.join(map(str, checked))}-bit "
                "ones (checked exact on an H200); other widths are not checked exact yet")
    dtype = getattr(layer, "params_dtype", None)
    if type(fmt).__name__ == "UnquantizedFormat" and dtype is not None and dtype not in UNQUANTIZED_DTYPES:
        return f"unquantized experts of dtype {dtype} are not supported (bf16, fp16 or fp32)"
    return None


# Layouts that are not paged, and why. TP and SGLang's standard EP dispatch are: every TP rank pages its shard of
# each expert, every EP rank its own experts (local ids from SGLang's StandardDispatcher, -1 for other ranks').
UNCHECKED = "not checked with paged experts yet"
PARALLEL_REFUSED = (  # (published parallel width, flag, why)
    ("pp_size", "--pp-size", "a pipeline stage builds only its own MoE layers, while --paged-experts-split indexes "
     "and auto sizes the MoE layers as if one process built them all"),
    ("dp_size", "--dp-size", f"data-parallel replicas are {UNCHECKED}"),
    ("attn_dp_size", "--attn-dp-size / --enable-dp-attention", "DP attention gathers every attention-DP rank's "
     f"tokens, with padding rows, into the MoE layers: {UNCHECKED}"),
    ("moe_dp_size", "--moe-dp-size", f"MoE data parallelism is {UNCHECKED}"),
    ("attn_cp_size", "--attn-cp-size", f"attention context parallelism is {UNCHECKED}"),
    ("dwdp_size", "--dwdp-size", "DWDP rebinds each MoE layer's expert tensors to full replicas, not K slots"),
)


def _parallel_problems(out: Problems, parallel, moe) -> None:
    for name, flag, why in PARALLEL_REFUSED:
        try:
            value = getattr(parallel, name, 1) or 1
        except (RuntimeError, ValueError):  # not published in this process
            value = 1
        if value > 1:
            out.add(f"{flag}={value}: {why} (need 1)")
    if getattr(moe, "enable_eplb", False):
        out.add("--enable-eplb is not supported (expert placement is moepage's residency)")
    if (n := getattr(moe, "ep_num_redundant_experts", 0) or 0) > 0:
        out.add(f"--ep-num-redundant-experts={n} is not supported: each expert has one home rank (need 0)")
    if (where := getattr(moe, "init_expert_location", "trivial") or "trivial") != "trivial":
        out.add(f"--init-expert-location {where} is not supported: moepage's host rows follow SGLang's trivial "
                "placement (rank r holds experts r*E/N .. (r+1)*E/N - 1)")
    if getattr(moe, "ep_join_mode", None) or getattr(moe, "elastic_ep_backend", None) not in (None, "none"):
        out.add("elastic EP (--elastic-ep-join-mode, --elastic-ep-backend) is not supported: ranks joining or "
                "leaving move experts between ranks")


def _tier_problems(out: Problems, decode: str | None) -> None:
    """A disk tier: the options' shared rules (``options.tier_problems``), and decode graphs that can wait on a disk."""
    budget, spill = setting("paged_experts_host_budget"), setting("paged_experts_spill_dir")
    for why in tier_problems(budget, spill, setting("paged_experts_host_warm"), named("paged_experts_spill_dir")):
        out.add(why)
    if budget is not None and decode == "full":
        out.add(f"{HOST_BUDGET}: a disk tier plans its steps on the host, which a full decode CUDA graph cannot "
                "replay (it cannot wait on a disk); pass --cuda-graph-backend-decode disabled")


def cpu_share_setting():
    """The CPU share asked for (None: off), or a ``ConfigError`` naming the flag."""
    value = setting("paged_experts_cpu_share")
    try:
        return parse_cpu_share(value)
    except ValueError as exc:
        raise ConfigError(f"{CPU_SHARE_WHERE}: {value!r} is {exc}") from None


def _split_problems(out: Problems, layer, fmt, decode: str | None) -> None:
    """A CPU share: steps planned on the host (eager decode; prefill eager or in the breakable graph's eager breaks),
    and a layer whose experts the CPU computes (``fused.fused_problem``)."""
    try:
        share = cpu_share_setting()
    except ConfigError as exc:
        out.add(str(exc))
        return
    if share is None:
        return
    if decode == "full":
        out.add(f"{CPU_SHARE_WHERE}: a split step is planned on the host, which a full decode CUDA graph cannot "
                "replay (it runs no Python); pass --cuda-graph-backend-decode disabled")
    if fmt is not None and (why := fused_problem(compat.fused_layout(layer, fmt), CPU_SHARE_WHERE)):
        out.add(why)


def _engine_problems(out: Problems, rt, layer, moe) -> None:
    """What SGLang is asked to do around the layer that paging cannot serve: all-to-all dispatch, speculative
    decoding, fused shared experts or top-k sums, a dummy load under a disk tier, another MoE runner."""
    if (a2a := compat.a2a_backend()) not in ("none", "None"):
        out.add(f"--moe-a2a-backend {a2a}: no all-to-all backend is supported (need none)")
    if getattr(rt.get_spec(), "speculative_algorithm", None):
        out.add("speculative decoding is not supported (drop --speculative-algorithm)")
    if getattr(layer, "num_fused_shared_experts", 0):
        out.add("fused shared experts are not supported: pass --disable-shared-experts-fusion")
    if getattr(moe, "enable_fused_moe_sum_all_reduce", False):
        out.add("--enable-fused-moe-sum-all-reduce is not supported: moepage performs the top-k sum itself")
    if compat.dummy_load() and setting("paged_experts_host_budget") is not None:
        out.add(f"--load-format dummy with a disk tier ({HOST_BUDGET}): the tier lays out and keeps the checkpoint's "
                "rows, and a dummy load has none; serve dummy weights without a disk tier, or load the checkpoint")
    runner = str(getattr(moe, "moe_runner_backend", "auto") or "auto")
    if runner not in RUNNER_BACKENDS:
        out.add(f"--moe-runner-backend {runner} is not supported; use one of {', '.join(RUNNER_BACKENDS)}")


def _graph_problems(out: Problems, store_can_gather: bool | None) -> str | None:
    """The CUDA graph backends paging serves (a disk tier: eager decode); returns the decode one."""
    decode, prefill = compat.graph_backends()
    if prefill not in (None, "breakable", "disabled"):
        out.add(f"prefill CUDA graph backend {prefill!r} is not supported: use breakable or disabled")
    tiered = bool(setting("paged_experts_host_budget") and setting("paged_experts_spill_dir"))
    if decode not in (None, "full", "disabled"):  # SGLang's breakable decode graph cannot hold the logits it returns
        out.add(f"decode CUDA graph backend {decode!r} is not supported: use "
                f"{'disabled (with a disk tier)' if tiered else 'full or disabled'}")
    if decode == "full" and store_can_gather is False and not tiered:
        out.add("decode CUDA graphs need a store that pages device-made plans: install moepage[cuda] "
                "(cuda-python) or pass --cuda-graph-backend-decode disabled")
    return decode


def _resident_problems(out: Problems, layer, num_resident, top_k: int | None) -> None:
    """K: given, an integer or auto, and within the K rule for this rank's experts."""
    if num_resident is None:
        out.add(f"{RESIDENT} is required with --enable-paged-experts (an integer or auto)")
    elif num_resident != "auto":  # auto is sized later from the GPU budget (sizing.py), never below top_k
        if isinstance(num_resident, bool) or not isinstance(num_resident, int):
            out.add(f"{RESIDENT} must be an integer or auto, got {num_resident!r}")
        else:
            local = getattr(layer, "num_local_experts", None) or num_resident
            if why := k_problem(num_resident, local, None if top_k is None else min(top_k, local), RESIDENT):
                ep = getattr(layer, "moe_ep_size", 1) or 1
                out.add(why if ep == 1 else f"{why} (K counts this rank's {local} of {layer.num_experts} experts "
                                            f"under --ep-size {ep})")


def _setting_problems(out: Problems, policy: str | None, prefetch: str | None) -> None:
    """The policy and the prefetch setting, readable."""
    if policy is not None:
        try:
            resolve_policy(policy)
        except ValueError as exc:
            out.add(f"{POLICY_WHERE}: {exc}")
    try:
        prefetch_setting(prefetch)
    except ConfigError as exc:
        out.add(str(exc))


def problems(layer, base_method, fmt, num_resident, top_k: int | None, store_can_gather: bool | None = None,
             policy: str | None = None, prefetch: str | None = None, compress: bool = False,
             store_name: str | None = None) -> Problems:
    """Everything that keeps ``layer`` from being paged with K = ``num_resident`` (an int, "auto", None when missing).
    ``store_can_gather``: whether this device's store serves device-planned (captured) steps; None skips that check."""
    rt = compat.runtime()
    out = Problems()
    moe = rt.get_exec().moe
    _parallel_problems(out, rt.get_parallel(), moe)
    _engine_problems(out, rt, layer, moe)
    decode = _graph_problems(out, store_can_gather)
    _resident_problems(out, layer, num_resident, top_k)
    _setting_problems(out, policy, prefetch)
    _tier_problems(out, decode)
    _split_problems(out, layer, fmt, decode)
    if why := _format_problem(fmt, layer, base_method):
        out.add(why)
    elif compress and (why := _compress_problem(fmt, layer, store_name)):
        out.add(why)
    return out


def check(layer, base_method, fmt, num_resident, top_k, store_can_gather=None, policy=None, prefetch=None,
          compress: bool = False, store_name: str | None = None) -> None:
    """Raise one ``ConfigError`` listing every problem, or return."""
    found = problems(layer, base_method, fmt, num_resident, top_k, store_can_gather, policy, prefetch, compress,
                     store_name)
    where = getattr(layer, "layer_name", "") or type(layer).__name__
    found.raise_if_any(f"moepage paged experts cannot serve this launch ({where})")
