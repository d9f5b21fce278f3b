"""Per-rank jobs of the SGLang TP / EP tests (``helpers.sglang_ranks.run_ranks`` runs them): one paged and one
unpaged real ``FusedMoE`` layer built at the rank's layout and loaded through their weight loaders from one bf16
checkpoint, then a sequence of steps on routing every rank sees alike (SGLang's router runs replicated), each step
planned on the host, on the device, or on the device under ``capture_mode`` (what a CUDA-graph capture plans).

A job returns plain records for the caller to compare across ranks: per step whether the paged output equals the
unpaged one (``torch.equal``) and the residency after it (``slot_expert``, ``expert_slot``), plus the host bytes and
the planner counts. The ranks also compare their residency among themselves over SGLang's TP group (``all_gather``)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from helpers import sglang as H

EXPERTS, HIDDEN, INTER, TOP_K = H.FMT_E, H.FMT_H, H.FMT_I, H.TOP_K  # bare_layer's shapes
# (how the step is planned, tokens, distinct experts): with K = 3 an eager step of one token (2 entries) is
# device-planned, larger ones host-planned; capture_mode plans any step on the device, in waves fixed by shapes.
STEPS = [("device", 1, 2), ("host", 4, 6), ("device", 1, 2), ("host", 7, 8), ("captured", 3, 5), ("device", 1, 2),
         ("host", 5, 7), ("captured", 2, 4), ("host", 3, 3), ("device", 1, 2)]


def checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """A bf16 checkpoint of one MoE layer, in Hugging Face's per-expert names."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(EXPERTS):
        for proj, shape in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)),
                            ("down_proj", (HIDDEN, INTER))):
            out[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = torch.randn(shape, generator=g).bfloat16()
    return out


def full_expert_bytes() -> int:
    """All E experts unsharded: what one process holds without TP or EP."""
    return EXPERTS * 3 * INTER * HIDDEN * torch.bfloat16.itemsize


def native_reference(layer, x: torch.Tensor, topk) -> torch.Tensor:
    """The unpaged layer's output at its layout, by SGLang's torch-native MoE (``moe_forward_native``). Under EP its
    routing holds -1 for other ranks' experts, which that CPU path cannot index: they go to appended zero experts
    (one per top-k column: that path counts a token once per distinct id), which add exactly 0 to each sum and leave
    every real expert's tokens as they were."""
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native

    ids = layer.dispatcher.dispatch(hidden_states=x, topk_output=topk).topk_output.topk_ids
    if not (ids < 0).any():
        return layer(x, topk)
    e, k = layer.w13_weight.shape[0], ids.shape[1]

    def with_zeros(w):
        return torch.cat([w.data, w.data.new_zeros(k, *w.shape[1:])])

    rows = SimpleNamespace(num_experts=e + k, w13_weight=with_zeros(layer.w13_weight),
                           w2_weight=with_zeros(layer.w2_weight))
    dropped = torch.arange(e, e + k, dtype=ids.dtype).expand_as(ids)
    return moe_forward_native(rows, x, topk._replace(topk_ids=torch.where(ids < 0, dropped, ids)),
                              layer.moe_runner_config)


def whole_layer(ckpt: dict, x: torch.Tensor, topk) -> torch.Tensor:
    """The layer without TP or EP, in float32 from the checkpoint: what the ranks' outputs must sum to (closely)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j, e in enumerate(topk.topk_ids[t].tolist()):
            w = {p: ckpt[f"model.layers.0.mlp.experts.{e}.{p}.weight"].float() for p in ("gate_proj", "up_proj",
                                                                                        "down_proj")}
            h = torch.nn.functional.silu(x[t].float() @ w["gate_proj"].T) * (x[t].float() @ w["up_proj"].T)
            out[t] += topk.topk_weights[t, j] * (h @ w["down_proj"].T)
    return out


def _layer(ckpt, **fields):
    with H.server_args(**fields):
        H.graph_config()
        layer = H.bare_layer()
        H.load_experts(layer, ckpt)
        layer.quant_method.process_weights_after_loading(layer)  # as SGLang's loader does after load_weights
        return layer


def _summed(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over SGLang's TP group (the all-reduce after a TP / EP MoE layer), in float32."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    t = t.float()
    dist.all_reduce(t, group=get_parallel().tp_group.cpu_group)
    return t


def _gathered(value):
    """``value`` of every rank of SGLang's TP group, in rank order."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    group = get_parallel().tp_group
    out = [None] * group.world_size
    dist.all_gather_object(out, value, group=group.cpu_group)
    return out


def paged_steps(rank: int, k: int, ep: int, seed: int = 0) -> dict:
    """Build the rank's layers at TP = world, EP = ``ep`` with K = ``k``; run ``STEPS``; return the records."""
    from sglang.srt.runtime_context import get_parallel

    from moepage.capture import capture_mode

    layout = dict(tp_size=get_parallel().tp_size, ep_size=ep)
    ckpt = checkpoint(seed)
    ref = _layer(ckpt, **layout)
    paged = _layer(ckpt, **H.paged_args(k), **layout)
    method, pager = paged.quant_method, paged.quant_method.pager
    rows_equal = {n: torch.equal(method.store.host_rows(method.layer_key, n), getattr(ref, n).data)
                  for n in method.names}
    rng = random.Random(seed)  # the same routing on every rank: the router's input is replicated
    steps, agreed = [], True
    with H.server_args(**layout):
        for i, (how, tokens, distinct) in enumerate(STEPS):
            ids = H.routing(rng, tokens, distinct)
            x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed * 100 + i)).bfloat16()
            topk = H.topk_output(ids, seed=i)
            with capture_mode(how == "captured"):
                out = paged(x, topk)
            residency = pager.read_residency()
            whole = whole_layer(ckpt, x, topk)
            record = dict(how=how, equal=torch.equal(out, native_reference(ref, x, topk)),
                          slot_expert=list(residency.slot_expert), expert_slot=list(residency.expert_slot),
                          whole_error=float((_summed(out) - whole).abs().max() / whole.abs().max()))
            if ep == 1:  # TP ranks see the same routing: they must decide the same, host- and device-planned
                maps = _gathered((record["slot_expert"], record["expert_slot"]))
                agreed &= all(m == maps[0] for m in maps)
            steps.append(record)
    stats = pager.read_stats()
    return dict(rank=rank, tp_rank=get_parallel().tp_rank, ep_rank=get_parallel().moe_ep_rank,
                local=method.num_experts, first=method.first_expert, rows_equal=rows_equal, steps=steps,
                agreed=agreed, host_bytes=method.store.host_bytes(),
                device_steps=int(pager.device_state.counters[0]), host_steps=pager.counts.steps,
                total_steps=stats.steps, misses=stats.misses)


class _Block(torch.nn.Module):
    """A MoE block as SGLang's models hold one: its router ``gate`` [E, H] beside ``experts``."""

    def __init__(self, experts, seed: int):
        super().__init__()
        self.gate = torch.nn.Linear(HIDDEN, EXPERTS, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            self.gate.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(seed)))
        self.experts = experts


def prefetch_steps(rank: int, k: int, ep: int, steps: int = 6) -> dict:
    """Two paged layers linked for next-layer prefetch (``--paged-experts-prefetch on``); per step of one token:
    layer 1's experts its router predicts from layer 0's input, as this rank's local ids, and layer 1's residency
    after layer 0's step (which prefetched them); then both layers' outputs against the unpaged ones."""
    from sglang.srt.runtime_context import get_parallel

    from moepage.integrations.sglang.prefetch import link_model

    layout = dict(tp_size=get_parallel().tp_size, ep_size=ep)
    ckpt = checkpoint(1)
    refs = [_layer(ckpt, **layout) for _ in range(2)]
    model = torch.nn.Sequential(*(_Block(_layer(ckpt, **H.paged_args(k), **layout), seed=i) for i in range(2)))
    assert link_model(model) == 1
    first, local = model[1].experts.quant_method.first_expert, model[1].experts.quant_method.num_experts
    rng, out = random.Random(5), []  # the same routing on every rank
    with H.server_args(**layout):
        for i in range(steps):
            x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(i)).bfloat16()
            predicted = torch.topk(model[1].gate(x), TOP_K, dim=-1).indices.int()
            wanted = sorted(e - first for e in predicted.flatten().tolist() if first <= e < first + local)
            topk = H.topk_output(H.routing(rng, 1, TOP_K), seed=i)
            equal = [torch.equal(model[0].experts(x, topk), native_reference(refs[0], x, topk))]
            resident = sorted(e for e in model[1].experts.quant_method.pager.read_residency().slot_expert if e >= 0)
            topk = H.topk_output(predicted, seed=i)  # layer 1 routes what was predicted: all hits
            equal.append(torch.equal(model[1].experts(x, topk), native_reference(refs[1], x, topk)))
            out.append(dict(wanted=wanted, resident=resident, equal=equal))
    stats = model[1].experts.quant_method.pager.read_stats()
    return dict(rank=rank, steps=out, prefetched=stats.prefetched, misses=stats.misses)


def disk_rows(rank: int, k: int, ep: int, spill: str, folder: str, compress: bool = False) -> dict:
    """The rank's paged layer over a disk tier (H = K + 1 rows, fewer than the rank's E: a budget holding all of them
    makes no disk tier; the checkpoint's folder known, loaded from its file;
    coded where ``compress``): whether it reused an earlier start's layout, the files its rows are read from, the
    tensors kept coded, and whether host-planned steps equal the unpaged layer's at its layout."""
    from pathlib import Path

    from safetensors.torch import load_file
    from sglang.srt.runtime_context import get_parallel

    layout = dict(tp_size=get_parallel().tp_size, ep_size=ep)
    ckpt = load_file(next(Path(folder).glob("*.safetensors")))
    ref = _layer(ckpt, **layout)
    tier = dict(_moepage_paged_experts_host_budget=str(min(k + 1, H.E // ep - 1)),
                _moepage_paged_experts_spill_dir=spill, model_path=folder, _moepage_paged_experts_compress=compress)
    paged = _layer(ckpt, **H.paged_args(k), **layout, **tier)
    method = paged.quant_method
    rng, equal = random.Random(3), []  # the same routing on every rank
    with H.server_args(**layout):
        for i, (_, tokens, distinct) in enumerate(STEPS):
            ids = H.routing(rng, tokens, distinct)
            x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(i)).bfloat16()
            topk = H.topk_output(ids, seed=i)
            equal.append(torch.equal(paged(x, topk), native_reference(ref, x, topk)))
    files = {n: sorted({x.path for row in rows for x in row}) for (_, n), rows in method.store.disk.rows.items()}
    return dict(rank=rank, reused=method.rows.reused, files=files, equal=equal,
                disk_reads=method.store.tier_stats(method.layer_key).host_misses,
                coded=sorted(method.store.layer_bytes(method.layer_key).coded))
