"""``from_pretrained``: an HF checkpoint larger than the GPU, built on the meta device and read tensor by tensor
(``checkpoint``): routed experts straight into the host store, every other weight onto ``device``, converted as
transformers converts it on load."""

from __future__ import annotations

import re

import torch
from torch import nn

from ...backends.protocol import PagedExpertStore
from ...config import PagingConfig, Problems, flag
from ...errors import ConfigError
from ...nn.find import as_device, find_experts, row_bytes
from ...nn.sources import Load
from ...nn.tier import TierOptions, budget_value, tier_options
from ...nn.wrap import paged_layers, wrap
from ...planning import host
from ...planning.sizing import read_header
from ...planning.tiers import read_trace
from ...units import format_bytes, parse_bytes
from .check import check_supported
from .fill import CheckpointFill

FROM_PRETRAINED = "moepage.integrations.transformers.from_pretrained"  # what its errors name
DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
               "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A floating torch dtype, one of ``DTYPE_NAMES`` or a torch dtype's name (``"torch."`` prefix allowed), else a
    ``ConfigError``."""
    found = dtype
    if isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        found = DTYPE_NAMES.get(name) or getattr(torch, name, None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ConfigError(f"dtype={dtype!r}: use a floating torch dtype (e.g. torch.bfloat16), 'auto' (the "
                          f"checkpoint's config) or one of {', '.join(map(repr, DTYPE_NAMES))}")
    return found


def _host_needed(model: nn.Module, device: torch.device, resident: object,
                 tier: TierOptions) -> tuple[int, str]:
    """Host memory the paged model holds, and what it is: every experts module's E host rows (with ``host_budget``: its
    H host rows, the rest on disk); on a CPU device also the other weights and the K slots."""
    layers = find_experts(model)
    rows = sum(row_bytes(m) for _, m in layers)
    what = f"all experts of {len(layers)} MoE layers"
    budget = budget_value(tier) if tier.budget is not None else None  # checked before the checkpoint is read
    if isinstance(budget, int):
        rows, what = sum(row_bytes(m, budget) for _, m in layers), f"{budget} experts of each MoE layer"
    elif isinstance(budget, str):
        rows, what = min(rows, parse_bytes(budget)), f"{tier.budget_name}={budget!r} of expert rows"
    if device.type != "cpu":
        return rows, what
    paged = {id(p) for _, m in layers for p in m.parameters(recurse=False)}
    rest = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()) if id(t) not in paged)
    slots = sum(row_bytes(m, resident) for _, m in layers) if isinstance(resident, int) else 0
    return rows + rest + slots, f"{what}, plus the other weights and the slots on the CPU device"


def _check_host_memory(path: str, needed: int, what: str) -> None:
    """Refuse, before any weight is read, a load that host memory cannot hold."""
    memory = host.host_memory_available()
    if memory is not None and not memory.fits(needed):
        fb = format_bytes
        raise ConfigError(
            f"{path}: a paged load needs {fb(needed)} ({needed} B) of host memory ({what}), but only "
            f"{fb(memory.available)} ({memory.available} B) is available ({memory.source}); free host memory, "
            "raise the limit, keep fewer expert rows in host memory and the rest on disk (from_pretrained's "
            "host_budget= and spill_dir=: the disk tier), or load a smaller checkpoint (moepage plan CHECKPOINT "
            "--gpu-mem X shows the figures)"
        )


def _free(model: nn.Module) -> None:
    """Swap every real parameter and buffer for a meta one (frees device memory even if a traceback keeps the model)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for n, t in list(table.items()):
                if t is not None and not t.is_meta:
                    meta = torch.empty_like(t, device="meta")
                    table[n] = nn.Parameter(meta, requires_grad=False) if isinstance(t, nn.Parameter) else meta


# Hugging Face's own from_pretrained keywords, as users type them by habit: what maps, and what does not.
_HF_ALIASES = {"torch_dtype": "dtype"}
_HF_IGNORED = {"low_cpu_mem_usage"}  # always low: weights are read tensor by tensor
_HF_REFUSED = {
    "quantization_config": "moepage loads the checkpoint's own format; quantize the checkpoint beforehand",
    "revision": "from_pretrained reads a local directory; download the revision first (hf download ... --revision R)",
    "cache_dir": "from_pretrained reads a local directory (hf download ... --local-dir DIR)",
    "token": "from_pretrained reads a local directory (hf download ... --local-dir DIR)",
}


def _hf_keywords(kwargs: dict, device, dtype) -> tuple[object, object, dict, dict]:
    """Split ``kwargs`` into what transformers' model construction takes (``attn_implementation``,
    ``trust_remote_code``) and ``wrap``'s options; map ``torch_dtype`` and a ``device_map`` naming one device; refuse
    the rest, naming what to pass instead, before anything is read."""
    import inspect

    problems, model_kwargs, wrap_kwargs = Problems(), {}, {}
    wrap_options = set(inspect.signature(wrap).parameters) - {"module", "resident", "backend", "device", "load"}
    for key, value in kwargs.items():
        if key in _HF_ALIASES:
            if dtype is not None and dtype != value:
                problems.add(f"{key}={value!r} and dtype={dtype!r} disagree; pass dtype= alone")
            dtype = value
        elif key == "device_map":
            if isinstance(value, (str, torch.device)) and str(value) not in ("auto", "balanced", "balanced_low_0",
                                                                             "sequential") and device is None:
                device = value
            else:
                problems.add(f"device_map={value!r}: moepage places the model itself (the routed experts in host "
                             "memory, K of them per layer on the device, everything else on the device); pass "
                             "device='cuda' (or 'cpu') instead")
        elif key in ("attn_implementation", "trust_remote_code"):
            model_kwargs[key] = value
        elif key in _HF_IGNORED:
            pass
        elif key in _HF_REFUSED:
            problems.add(f"{key}=: {_HF_REFUSED[key]}")
        elif key in wrap_options:
            wrap_kwargs[key] = value
        else:
            problems.add(f"unexpected keyword {key}=; from_pretrained takes device, dtype, backend, "
                         f"experts_implementation, progress, attn_implementation, trust_remote_code and moepage.wrap's "
                         f"options ({', '.join(sorted(wrap_options))})")
    problems.raise_if_any(FROM_PRETRAINED)
    return device, dtype, model_kwargs, wrap_kwargs


def from_pretrained(
    path: str,
    resident: int,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    backend: str | PagedExpertStore | None = None,
    experts_implementation: str | None = None,
    progress: bool = True,
    **kwargs,
) -> nn.Module:
    """Load the local HF safetensors checkpoint at ``path`` as an ``AutoModelForCausalLM`` with its routed experts paged
    (``resident`` = K slots per layer), never holding all experts on the device nor an ``[E, ...]`` expert tensor
    outside the host store.

    - ``device``: where the model and the slots go (default: CUDA when available, else CPU).
    - ``dtype``: the weights' dtype (default: the config's ``dtype``, else float32); keep-in-fp32 parameters stay so.
    - ``backend``, ``**wrap_kwargs``: as ``moepage.wrap``.
    - ``experts_implementation``: "eager", "grouped_mm" or "batched_mm" (default: transformers' choice).
    - ``progress``: show a progress bar (tqdm) over the checkpoint's tensors (with ``compress=True``, one over the
      coding too; over a disk tier each says what was written to the folder or reused).
    - Hugging Face's own keywords: ``torch_dtype`` is ``dtype``; ``attn_implementation`` and ``trust_remote_code``
      reach the model's construction; ``device_map`` naming one device is ``device`` (``"auto"`` is refused: moepage
      places the model itself); anything else is refused, saying what to pass instead.

    Returns the model in eval mode with no parameter requiring grad (paged models run inference only, so ``model(...)``
    needs no ``torch.no_grad()``). Reads stacked experts (``save_pretrained(..., save_original_format=False)``,
    gpt-oss) and per-expert keys (``experts.3.gate_proj.weight``: ``save_pretrained``'s default and most hub
    checkpoints) through transformers' conversion mapping. On any failure everything allocated is freed."""
    from transformers import GenerationConfig

    device, dtype, model_kwargs, wrap_kwargs = _hf_keywords(kwargs, device, dtype)
    coded, progress, tier = _options(path, wrap_kwargs, progress)
    device = as_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    fill, written = _meta_model(path, resident, device, dtype, experts_implementation, model_kwargs, tier, coded,
                                progress)
    model = fill.model
    try:
        wrap(model, resident, backend=backend, device=device, load=Load(fill, FROM_PRETRAINED, written, progress),
             **wrap_kwargs)
        try:
            model.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:
            pass
        return model.eval()
    except BaseException:  # wrap rolled back its own failures; after it, its lifetime releases all
        for lifetime in {id(layer.lifetime): layer.lifetime for layer in paged_layers(model)}.values():
            lifetime.rollback()
        _free(model)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        raise


def _options(path: str, wrap_kwargs: dict, progress: object) -> tuple[bool, bool, TierOptions]:
    """The options and ``MOEPAGE_*`` variables wrap reads, checked before the checkpoint is: whether rows are coded,
    whether a bar shows, and the disk tier asked for."""
    problems = Problems()
    coded = PagingConfig.from_options(problems, policy=wrap_kwargs.get("policy"), verify=wrap_kwargs.get("verify"),
                                      device_planner=wrap_kwargs.get("device_planner"),
                                      compress=wrap_kwargs.get("compress"), cpu_share=wrap_kwargs.get("cpu_share")
                                      ).compress
    try:
        progress = flag(progress, "progress")
    except ConfigError as exc:
        problems.add(str(exc))
    tier = tier_options(wrap_kwargs.get("host_budget"), wrap_kwargs.get("spill_dir"), wrap_kwargs.get("host_warm"))
    try:
        if tier.budget is not None:
            budget_value(tier)
    except ConfigError as exc:
        problems.add(str(exc))
    if tier.warm is not None and tier.budget is not None:  # readable (whether it is this model's: at wrap)
        try:
            read_trace(tier.warm)
        except ValueError as exc:
            problems.add(f"{tier.warm_name}={tier.warm!r}: {exc}")
    problems.raise_if_any(f"{FROM_PRETRAINED}: cannot load {path}")
    return coded, bool(progress), tier


def _meta_model(path: str, resident: object, device: torch.device, dtype: object, experts_implementation: str | None,
                model_kwargs: dict, tier: TierOptions, coded: bool, progress: bool) -> tuple[CheckpointFill, int]:
    """The model built on the meta device and its loader (``CheckpointFill``), host memory checked for it first; and
    the bytes its rows cast on load write into a disk tier's folder (not read in place: its free space is checked
    for them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from . import checkpoint as ckpt

    asked = None if dtype is None or dtype == "auto" else _resolve_dtype(dtype)
    files = ckpt.checkpoint_files(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=model_kwargs.get("trust_remote_code", False))
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    dtype = asked or _resolve_dtype(getattr(config, "dtype", None) or torch.float32)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **model_kwargs)
    check_supported(model)
    _check_host_memory(path, *_host_needed(model, device, resident, tier))
    model.requires_grad_(False)  # moepage computes no gradients: plain model(...) runs as inference
    meta_keys = set(model.state_dict().keys())
    headers = {file: read_header(file) for file in files}
    written = ckpt.written_bytes(model, headers, meta_keys) if tier.budget is not None else 0
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    keep_fp32 = re.compile("|".join(p.replace("*", ".*") for p in plan)) if plan else None
    return CheckpointFill(path, model, files, headers, meta_keys, device, keep_fp32, coded, progress), written
