"""SGLang's expert distribution recorder dumps (``--expert-distribution-recorder-mode per_token``) read as a routing
``Trace``: one step per recorded forward pass, its tokens' physical expert ids mapped to logical ones.

A dump (``expert_distribution_recorder_<time>_<rank>.pt``, written by ``_DetailAccumulator.dump`` in SGLang 0.5.23's
``sglang/srt/eplb/expert_distribution.py``) is ``{"records": [{forward_pass_id, rank, gatherer_key, input_ids,
positions, extend_seq_lens, forward_mode, topk_ids_of_layer [layers, tokens, 8] (physical ids, -1 padding), ...}],
"last_physical_to_logical_map" [layers, physical experts]}``. Its layers are all the model's decoder layers: those
never routed in the dump (dense layers, another pipeline stage's) are dropped, so layer i of the trace is the i-th MoE
layer, as a split file counts them. E is the number of logical experts the map names, top_k the most ids a token has.
A dump is one rank's: with tensor parallelism every rank routes the same tokens, so any rank's file will do.
Reading it needs torch only, not SGLang.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ...errors import ConfigError

# sglang.srt.model_executor.forward_batch_info.ForwardMode values (0.5.23) of passes that prefill: EXTEND, MIXED
# (chunked prefill beside decodes), SPLIT_PREFILL. DECODE is 2.
PREFILL_MODES = frozenset({1, 3, 8})
LAYOUT = ('SGLang expert distribution dump {"records": [{forward_mode, topk_ids_of_layer [layers, tokens, k], ...}], '
          '"last_physical_to_logical_map" [layers, physical experts]} (per_token mode)')


def read_dump(path: str | os.PathLike) -> dict:
    """The dump's dict, loaded without running any pickled code (``weights_only``)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except Exception as exc:  # torch.load raises pickle, zip and runtime errors alike
        raise ConfigError(f"{path}: not a {LAYOUT}: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(data, dict) or not {"records", "last_physical_to_logical_map"} <= set(data):
        what = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"{path}: not a {LAYOUT}; it holds {what}")
    return data


def dump_trace(data: dict, name: str = "sglang"):
    """The trace of a dump's dict (``read_dump``)."""
    from ...planning.traces import from_steps

    p2l = torch.as_tensor(data["last_physical_to_logical_map"]).long()
    records = [r for r in data["records"] if r.get("gatherer_key", "primary") == "primary"]
    if p2l.dim() != 2 or p2l.numel() == 0:
        raise ConfigError(f"{name}: last_physical_to_logical_map has shape {tuple(p2l.shape)}; expected "
                          "[layers, physical experts]")
    if not records:
        raise ConfigError(f"{name}: the dump has no records: was the server started with "
                          "--expert-distribution-recorder-mode per_token, and did requests run between "
                          "/start_expert_distribution_record and /dump_expert_distribution_record?")
    num_layers, num_physical = p2l.shape
    steps, prefill, routed, top_k = [], [], torch.zeros(num_layers, dtype=torch.bool), 0
    for record in sorted(records, key=lambda r: r["forward_pass_id"]):
        ids = record.get("topk_ids_of_layer")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 3 or ids.shape[0] != num_layers:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ConfigError(f"{name}: forward pass {record['forward_pass_id']}: topk_ids_of_layer is {shape}; "
                              f"expected [{num_layers} layers, tokens, k] (per_token mode records it)")
        ids = ids.long()
        if ids.shape[1] == 0:  # an idle pass (data-parallel attention): no tokens here
            continue
        valid = ids >= 0
        if bool((ids >= num_physical).any()):
            raise ConfigError(f"{name}: forward pass {record['forward_pass_id']}: physical expert id "
                              f"{int(ids.max())} is outside the map's {num_physical} (fused shared experts are not "
                              "recorded correctly by SGLang; launch without shared-experts fusion)")
        logical = torch.where(valid, p2l.gather(1, ids.clamp(min=0).reshape(num_layers, -1)).reshape(ids.shape), -1)
        routed |= valid.flatten(1).any(1)
        top_k = max(top_k, int(valid.sum(-1).max()))
        if record.get("forward_mode") in PREFILL_MODES:
            prefill.append(len(steps))
        steps.append(logical.reshape(num_layers, -1))
    if not steps or not bool(routed.any()):
        raise ConfigError(f"{name}: no forward pass in the dump routed any token")
    keep = routed.nonzero().flatten()
    return from_steps(name, [s[keep].numpy() for s in steps], int(p2l.max()) + 1, top_k, prefill)


def load_dump(path: str | os.PathLike):
    """The trace of the dump file at ``path``."""
    return dump_trace(read_dump(path), f"{Path(path).parent.name}/{Path(path).stem}")
