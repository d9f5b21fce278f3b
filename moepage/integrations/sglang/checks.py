"""Startup checks: every reason the server configuration or a layer cannot be paged, reported
together in one ``ConfigError`` when the first ``FusedMoE`` layer is built.

``problems`` only reads the published SGLang configuration (``sglang.srt.runtime_context``) and
the layer; it allocates nothing, so a rejected launch fails before any weight is loaded.
"""

from __future__ import annotations

from ...errors import ConfigError
from ...residency import resolve_policy
from .formats import format_for, format_problem
from .prefetch import WHERE as PREFETCH_WHERE, parse as parse_prefetch

RUNNER_BACKENDS = ("auto", "triton", "marlin")


def _graph_backends():
    """(decode backend, prefill backend) of the published CUDA-graph config (None: unpublished)."""
    from sglang.srt.runtime_context import get_exec

    try:
        cfg = get_exec().graph.cuda_graph_config
    except ValueError:
        return None, None
    if cfg is None:
        return None, None
    return cfg.decode.backend, cfg.prefill.backend


def _a2a_backend() -> str:
    from sglang.srt.runtime_context import get_exec

    name = str(getattr(get_exec().moe, "moe_a2a_backend", "none") or "none")
    try:  # the resolved flag, where a launcher has set it
        from sglang.srt.layers.moe.utils import get_moe_a2a_backend

        flag = get_moe_a2a_backend()
        if not flag.is_none():
            name = str(getattr(flag, "value", flag))
    except Exception:  # pragma: no cover - older/newer flag layouts
        pass
    return name


def problems(
    layer, base_method, num_resident, top_k: int | None, store_can_gather: bool | None = None, policy: str | None = None,
    prefetch: str | None = None,
) -> list[str]:
    """Everything that keeps ``layer`` (with ``base_method``) from being paged with K =
    ``num_resident`` (an int or "auto"; None when missing). ``store_can_gather``: whether the store chosen
    for this device can serve device-planned (captured) steps; None skips that check."""
    from sglang.srt.runtime_context import get_exec, get_model, get_parallel, get_spec

    out: list[str] = []
    parallel = get_parallel()
    for name in ("tp_size", "ep_size", "pp_size", "dp_size"):
        value = getattr(parallel, name, 1) or 1
        if value > 1:
            out.append(f"--{name.replace('_', '-')}={value}: paged experts run on one GPU (need 1)")
    moe = get_exec().moe
    if getattr(moe, "enable_eplb", False):
        out.append("--enable-eplb is not supported (expert placement is moepage's residency)")
    a2a = _a2a_backend()
    if a2a not in ("none", "None"):
        out.append(f"--moe-a2a-backend {a2a}: no all-to-all backend is supported (need none)")
    if getattr(get_spec(), "speculative_algorithm", None):
        out.append("speculative decoding is not supported (drop --speculative-algorithm)")
    if getattr(layer, "num_fused_shared_experts", 0):
        out.append("fused shared experts are not supported: pass --disable-shared-experts-fusion")
    if getattr(moe, "enable_fused_moe_sum_all_reduce", False):
        out.append("--enable-fused-moe-sum-all-reduce is not supported: moepage performs the top-k sum itself")
    if getattr(get_model(), "load_format", None) == "dummy":
        out.append("--load-format dummy is not supported: the host store needs the checkpoint's weights")
    runner = str(getattr(moe, "moe_runner_backend", "auto") or "auto")
    if runner not in RUNNER_BACKENDS:
        out.append(f"--moe-runner-backend {runner} is not supported; use one of {', '.join(RUNNER_BACKENDS)}")
    decode, prefill = _graph_backends()
    if prefill not in (None, "breakable", "disabled"):
        out.append(f"prefill CUDA graph backend {prefill!r} is not supported: use breakable or disabled")
    if decode not in (None, "full", "disabled"):
        out.append(f"decode CUDA graph backend {decode!r} is not supported: use full or disabled")
    if decode == "full" and store_can_gather is False:
        out.append(
            "decode CUDA graphs need a store that pages device-made plans: install moepage[cuda] "
            "(cuda-python) or pass --cuda-graph-backend-decode disabled"
        )
    if num_resident is None:
        out.append("--paged-experts-num-resident is required with --enable-paged-experts (an integer or auto)")
    elif num_resident == "auto":
        pass  # sized later from the GPU budget (sizing.py), which refuses K < top_k itself
    elif isinstance(num_resident, bool) or not isinstance(num_resident, int):
        out.append(f"--paged-experts-num-resident must be an integer or auto, got {num_resident!r}")
    elif top_k is not None and num_resident < top_k:
        out.append(f"--paged-experts-num-resident={num_resident} is below the router's top_k={top_k}")
    elif num_resident < 1:
        out.append(f"--paged-experts-num-resident={num_resident} must be at least 1")
    elif (e := getattr(layer, "num_local_experts", None)) is not None and num_resident > e:
        # One rule with moepage.wrap: K > E is refused, not clamped (auto never exceeds E).
        out.append(
            f"--paged-experts-num-resident={num_resident} exceeds this layer's E={e} routed experts; "
            f"use K = E = {e} to keep every expert resident"
        )
    if policy is not None:
        try:
            resolve_policy(policy)
        except ValueError as exc:
            out.append(f"--paged-experts-policy / MOEPAGE_POLICY: {exc}")
    try:
        parse_prefetch(prefetch)
    except ValueError as exc:
        out.append(f"{PREFETCH_WHERE}: {exc}")
    fmt = format_problem(base_method, getattr(layer, "params_dtype", None))
    if fmt is not None:
        out.append(fmt)
    elif "Marlin" in format_for(base_method).label and (decode == "full" or prefill == "breakable"):
        # The Marlin contract compacts a wave's entries with a host read of their count.
        out.append(
            f"{format_for(base_method).label} steps read their entry count on the host, so they cannot be "
            "captured yet: pass --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled"
        )
    return out


def check(layer, base_method, num_resident, top_k, store_can_gather=None, policy=None, prefetch=None) -> None:
    """Raise one ``ConfigError`` listing every problem, or return."""
    found = problems(layer, base_method, num_resident, top_k, store_can_gather, policy, prefetch)
    if found:
        where = getattr(layer, "layer_name", "") or type(layer).__name__
        raise ConfigError(
            f"moepage paged experts cannot serve this launch ({where}):\n  - " + "\n  - ".join(found)
        )
