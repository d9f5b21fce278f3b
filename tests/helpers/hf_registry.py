"""Tiny random MoE architectures, derived from transformers' own registries.

Each model type of ``CONFIG_MAPPING_NAMES`` whose modeling module defines a *stacked experts*
module (own parameters ``gate_up_proj``/``up_proj`` and ``down_proj``: 3-D, leading expert dim E)
is built from its config defaults shrunk by generic rules; only ``_OVERRIDES`` names models. A
type that cannot be built or run is in :func:`skipped_archs` with its reason, never dropped.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import torch
import transformers.models
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.auto import configuration_auto as _ca
from transformers.models.auto import modeling_auto as _ma

PROMPT = (2, 16)  # (batch, seq) of the smoke forward
_STACKED_SRC = re.compile(r"self\.(gate_up_proj|up_proj)\s*=\s*nn\.Parameter")
_EXPERTS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "top_k_experts", "moe_topk", "moe_k", "top_k")
_LAYERS = ("num_hidden_layers", "num_layers")
# Fields that a default config may leave None although the model needs them (MoE switched off, or
# only ever set by a checkpoint): a None there is filled with the rule's value.
_FILL_NONE = re.compile(
    rf"^({'|'.join(_EXPERTS + _TOP_K)}|moe_intermediate_size|n_shared_experts|head_dim|sliding_window)$")
# (field-name regex, upper bound or f(old value, defaults) -> new value); the first match wins.
_RULES: list[tuple[str, Any]] = [
    (r"^hidden_size$", 32),
    # FFN sizes a multiple of 32, as every real model's: CPU elementwise kernels then have no scalar tail
    (r"intermediate_size|ffn_hidden_size|share_expert_dim|router_hidden_size", 32),
    (rf"^({'|'.join(_EXPERTS)})$", lambda v, d: 8),
    (r"^zero_expert_num$", 2),
    # top_k 3 (so the order of the weighted sum matters), but a top-1 MoE by design stays top-1
    (rf"^({'|'.join(_TOP_K)})$", lambda v, d: 1 if v == 1 and max(d.get(k) or 0 for k in _EXPERTS) > 1
     else 3),
    (r"^(n_group|num_expert_group)$", 2),  # 2 groups of 4 experts, 1 kept: 4 candidates >= top_k
    (r"^topk_group$", 1),
    (r"^(n_shared_experts|num_shared_experts|moe_num_shared_experts)$", 1),
    (r"^(first_k_dense_replace|num_dense_layers|moe_layer_start_index)$", 1),
    (r"_layer_period$", 2),  # periodic layer patterns (jamba): period 2, offset <= 1
    (r"_layer_offset$", 1),
    # MHA stays MHA (MLA needs it), GQA gets 2 kv heads
    (r"^(swa_)?num_key_value_heads$", lambda v, d: 4 if v == d.get("num_attention_heads") else min(v, 2)),
    (r"^linear_num_key_heads$", 2),
    (r"num_attention_heads$|^index_n_heads$|^linear_num_(value_)?heads$|^mamba_n?u?m?_heads$", 4),
    (r"^(o_groups|index_kpool)$", 2),
    (r"^(n_groups|mamba_n_groups)$", 1),
    (r"^qk_rope_head_dim$", 4),
    # MLA: head_dim is the rope part or the whole q/k head; keep its ratio to qk_rope_head_dim
    (r"^head_dim$", lambda v, d: v * 4 // d["qk_rope_head_dim"] if v and d.get("qk_rope_head_dim") else 8),
    (r"head_dim$", 8),
    (r"lora_rank$|lowrank$", 16),
    (r"^vocab_size", 128),
    (r"^max_position_embeddings$", 256),
    (r"^(sliding_window(_size)?|attention_chunk_size|index_topk|(mamba_)?chunk_size)$", 8),
    (r"^(ssm_state_size|mamba_d_state|hidden_size_per_layer_input|ple_embed_dim)$", 8),
    (r"^mamba_dt_rank$", 4),
]
_FIXED = {"initializer_range": 0.3, "bos_token_id": None, "eos_token_id": None, "pad_token_id": 0}
# Per-model overrides, only where the default config cannot build or run at all:
_OVERRIDES: dict[str, dict[str, Any]] = {
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # default layer_types None; the model indexes it
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse"]},  # same, for mlp_layer_types
    # the default has no attention layer, and forward needs one (Cache.get_seq_length)
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # the default has indexed-attention layers but leaves every QSA indexer field None
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                       "indexer_budget": 8, "indexer_compress_ratio": 2},
}


@dataclasses.dataclass(frozen=True)
class MoeArch:
    """One MoE model type that builds and runs, with its tiny config (see :func:`moe_archs`)."""

    model_type: str
    config: PretrainedConfig  # tiny, random-init friendly
    model_class: type  # instantiate with model_class(config)
    experts_class: str  # class name of its stacked experts module
    causal_lm: bool  # supports .generate with input_ids
    top_k: int  # as seen by the experts' forward
    num_experts: int  # E, down_proj.shape[0]
    vocab_size: int
    top_k_attr: str = ""  # config field holding top_k; "" if the router ignores the config
    dispatches: bool = True  # forward follows set_experts_implementation (use_experts_implementation)

    def build(self, seed: int = 0) -> PreTrainedModel:
        """A fresh eval-mode model on its own copy of the config (set_experts_implementation
        writes to the config, which would otherwise leak into the next model built from it)."""
        torch.manual_seed(seed)
        model = self.model_class(copy.deepcopy(self.config)).eval()
        # Some models initialise their router to zeros (afmoe, ernie4_5_moe): every token would
        # then pick the same experts and no step would need a second wave. Redraw all-zero weights.
        std = getattr(self.config.get_text_config(), "initializer_range", 0.3) or 0.3
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point() and p.dim() >= 2 and not p.any():
                    p.normal_(0.0, std)
        return model


def _shrink(name: str, value: Any, d: dict) -> Any:
    """Apply the first rule matching ``name`` to an int, a list of ints, or a None to fill."""
    for pattern, new in _RULES:
        if re.search(pattern, name):
            if isinstance(value, list) and value and all(type(v) is int for v in value):
                return [_shrink(name, v, d) for v in value]
            if value is None and _FILL_NONE.match(name) or type(value) is int and value > 0:
                return new(value, d) if callable(new) else min(value or new, new)
            return value
    return value


def _select_layers(d: dict, n_layers: int, at_least: int) -> tuple[list[int], dict]:
    """Keep the first layer of each distinct kind across the per-layer lists (layer_types,
    mlp_layer_types, ...), at least ``at_least`` layers; also remap lists of layer indices."""
    per_layer = [k for k, v in d.items() if isinstance(v, list) and len(v) == n_layers
                 and not (k.endswith("layers") and v == list(range(n_layers)))]
    kinds = [tuple(str(d[k][i]) for k in per_layer) for i in range(n_layers)]
    keep = [i for i in range(n_layers) if kinds[i] not in kinds[:i]]
    keep = sorted((keep + [i for i in range(n_layers) if i not in keep])[: max(at_least, len(keep))])
    out = {k: [d[k][i] for i in keep] for k in per_layer}
    for k, v in d.items():  # lists of layer indices (moe_layers, mlp_only_layers, ...)
        if k not in out and k.endswith(("layers", "layer_ids")) and isinstance(v, list) \
                and all(type(i) is int for i in v):
            out[k] = [new for new, old in enumerate(keep) if old in v]
    return keep, out


def _tiny(config: PretrainedConfig, at_least: int = 2) -> PretrainedConfig:
    """Re-instantiate ``config``'s class with its size-like fields shrunk, sub-configs too. A field
    whose class default is None but which holds a value is derived by the config (head_dim...);
    it is left to the config unless it keeps its value once the others have shrunk."""
    cls, fields = type(config), {f.name: f.default for f in dataclasses.fields(config)}
    as_dict = config.to_dict()  # keyed by attribute_map targets: read back by field name
    d = {k: as_dict.get(cls.attribute_map.get(k, k), as_dict.get(k)) for k in fields}
    over = {k: _shrink(k, v, d) for k, v in d.items() if fields[k] is not None or v is None}
    over |= {k: True for k, v in d.items() if v is False and re.match(r"(enable|use)_moe", k)}
    over = {k: v for k, v in over.items() if v != d[k]} | {k: v for k, v in _FIXED.items() if k in fields}
    over |= {k: _tiny(getattr(config, k)).to_dict() for k in getattr(config, "sub_configs", None) or {}
             if isinstance(getattr(config, k, None), PretrainedConfig)}
    rope = d.get("rope_parameters") or {}
    is_moe = any((d.get(k) or 0) > 1 for k in _EXPERTS)  # the modeling fallback is for the MoE text model
    default = is_moe and re.search(r'"mrope_section",\s*\[([\d,\s]+)\]', _source(config.model_type))
    if sections := rope.get("mrope_section") or default and [int(x) for x in default[1].split(",")]:
        # head_dim 16, so that each section keeps >= 1 of the rotary frequencies it must sum to
        half = int(16 * (rope.get("partial_rotary_factor") or d.get("partial_rotary_factor") or 1.0)) // 2
        new = [max(1, round(x * half / sum(sections))) for x in sections]
        new[new.index(max(new))] += half - sum(new)
        over |= {"head_dim": 16, "rope_parameters": {**rope, "mrope_section": new}}
    if layer_key := next((k for k in _LAYERS if type(d.get(k)) is int), None):
        keep, lists = _select_layers(d, d[layer_key], at_least)
        over |= {k: v for k, v in lists.items() if k in fields} | {layer_key: len(keep)}
        if per_layer := {int(k): v for k, v in (as_dict.get("per_layer_config") or {}).items()}:
            over["per_layer_config"] = {new: {k: _shrink(k, v, d) for k, v in per_layer[old].items()}
                                        for new, old in enumerate(keep) if old in per_layer}
    over |= _OVERRIDES.get(config.model_type, {})
    first = cls(**over)
    late = {k: _shrink(k, v, d) for k, v in d.items()
            if fields[k] is None and k not in over and v is not None and getattr(first, k, None) == v}
    return cls(**over, **{k: v for k, v in late.items() if v != d[k]})


def tiny_config(model_type: str) -> PretrainedConfig:
    """Tiny random-init config of ``model_type``: its class defaults, shrunk by the generic rules.
    (For a multimodal wrapper the text part is tiny; its vision/audio towers need not be.)"""
    return _tiny(_ca.CONFIG_MAPPING[model_type]())


@functools.cache
def _source(model_type: str) -> str:
    """Source of the type's modeling module, read without importing it ("" if none)."""
    name = _ca.model_type_to_module_name(model_type)
    path = Path(transformers.models.__file__).parent / name / f"modeling_{name}.py"
    return path.read_text() if path.exists() else ""


@functools.cache
def _candidates() -> tuple[str, ...]:
    """Config model types whose modeling module defines a stacked experts class."""
    return tuple(t for t in _ca.CONFIG_MAPPING_NAMES if _STACKED_SRC.search(_source(t)))


def _model_class(model_type: str) -> type:
    """The type's auto class (causal LM, else base model, else any auto mapping), else a model class
    of its modeling module whose ``config_class`` is its config (sub-configs without auto class)."""
    name = _ca.model_type_to_module_name(model_type)
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    mappings = ["MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES"]
    mappings += sorted(n for n in dir(_ma) if re.fullmatch(r"MODEL_\w*MAPPING_NAMES", n) and n not in mappings)
    for mapping in mappings:
        if isinstance(found := getattr(_ma, mapping).get(model_type), str) and hasattr(module, found):
            return getattr(module, found)
    own = [c for n, c in vars(module).items() if inspect.isclass(c) and issubclass(c, PreTrainedModel)
           and c.config_class is _ca.CONFIG_MAPPING[model_type] and n == c.__name__ and "PreTrained" not in n]
    if not own:
        raise LookupError("no auto model class, and no model class of its modeling module takes its config")
    return min(own, key=lambda c: (not c.__name__.endswith("ForCausalLM"), not c.__name__.endswith("Model")))


def stacked_experts(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` holding ``gate_up_proj``/``up_proj`` and ``down_proj`` as 3-D
    per-expert stacks. E is ``down_proj.shape[0]``; ``gate_up_proj`` may have more rows (longcat
    stacks its identity "zero experts" there)."""
    found = []
    for module in model.modules():
        p = dict(module.named_parameters(recurse=False))
        up, down = p.get("gate_up_proj", p.get("up_proj")), p.get("down_proj")
        if up is not None and down is not None and up.dim() == down.dim() == 3 \
                and up.shape[0] >= down.shape[0]:
            found.append(module)
    return found


def _build(model_type: str) -> MoeArch:
    """Build and smoke-run one type; raises, with the reason, when it cannot."""
    config = tiny_config(model_type)
    if (text := config.get_text_config()) is not config and text.model_type in _candidates():
        raise LookupError(f"multimodal wrapper: its MoE text model is covered by {text.model_type!r}")
    if not any((getattr(config, k, None) or 0) > 1 for k in _EXPERTS):
        raise LookupError(f"not an MoE config: no expert count among {', '.join(_EXPERTS)}")
    model_class = _model_class(model_type)
    layer_key = next((k for k in _LAYERS if type(getattr(config, k, None)) is int), None)
    while True:  # the fewest layers that hold an MoE layer, should a layer pattern need more
        torch.manual_seed(0)
        model = model_class(config).eval()
        if (experts := stacked_experts(model)) or not layer_key or getattr(config, layer_key) >= 6:
            break
        config = _tiny(_ca.CONFIG_MAPPING[model_type](), getattr(config, layer_key) + 1)
    if not experts:
        raise LookupError(f"{model_class.__name__} has no stacked experts module")
    forward = inspect.unwrap(type(experts[0]).forward)
    routing = len(inspect.signature(forward).parameters) >= 4  # self, hidden_states, top_k_index, top_k_weights
    seen: list[int] = []  # smoke forward; the top_k the experts are called with
    hook = experts[0].register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append((args[1] if len(args) > 1 else kwargs["top_k_index"]).shape[-1]),
        with_kwargs=True) if routing else None
    with torch.no_grad():
        model(input_ids=torch.randint(0, config.vocab_size, PROMPT, generator=torch.Generator().manual_seed(0)))
    if hook is not None:
        hook.remove()
    if not routing:  # stacked, but computing every expert itself (llama4): in the matrix as a refusal
        seen = [next(getattr(config, k) for k in _TOP_K if isinstance(getattr(config, k, None), int))]
    if not seen:
        raise RuntimeError(f"forward ran but never called {type(experts[0]).__name__}")
    top_k, top_k_attr = seen[0], next((k for k in _TOP_K if getattr(config, k, None) == seen[0]), "")
    if not top_k_attr and (attr := next((k for k in _TOP_K if isinstance(getattr(config, k, None), int)), None)):
        setattr(config, attr, top_k)  # a router with a fixed top_k (phimoe's sparsemixer): the config says so too
        top_k_attr = attr
    return MoeArch(model_type, config, model_class, type(experts[0]).__name__, model_class.can_generate(),
                   top_k, experts[0].down_proj.shape[0], config.vocab_size, top_k_attr,
                   hasattr(type(experts[0]).forward, "__wrapped__"))


@functools.cache
def _scan() -> tuple[tuple[MoeArch, ...], dict[str, str]]:
    archs, skipped = [], {}
    for model_type in _candidates():
        try:
            archs.append(_build(model_type))
        except Exception as error:  # noqa: BLE001 - each reason is reported by skipped_archs()
            skipped[model_type] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    return tuple(archs), skipped


def moe_archs() -> list[MoeArch]:
    """Every MoE model type whose tiny model builds and runs a forward on CPU (built once, cached).
    Check ``dispatches`` before relying on ``set_experts_implementation``."""
    return list(_scan()[0])


def skipped_archs() -> dict[str, str]:
    """model_type -> why a type whose modeling module defines stacked experts is not in
    :func:`moe_archs` (multimodal wrapper, non-MoE sub-config, not routing-forward, or an error)."""
    return dict(_scan()[1])
