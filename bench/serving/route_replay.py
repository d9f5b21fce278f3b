"""Bench only: an engine's routing (SGLang's or vLLM's) replaced by a trace's, so that the engine's hit rates and tok/s
reflect a workload's locality instead of random weights' near-uniform routing (or, for dummy weights, a defined
uniform routing). Unpaged, moepage and the built-in replay the same ids, so their outputs still compare (with each
other, not with a model that routes for itself).

A table (``write_table``) holds ``[layers, steps, top_k]`` expert ids: model layer ``l`` replays trace layer
``l * trace_layers // layers``. In the engine every MoE layer's ``select_experts`` (SGLang's own routing, weights
kept) has its ids overwritten: batch row ``r`` at forward ``s`` takes step ``(r * spread + s) % steps``, so each row
walks the trace one step per decode step (its locality) and the rows of a batch start apart; padded rows stay -1.
The forward counter lives on the device and advances in layer 0, so captured decode replays it too.

In vLLM every MoE runner's router (``FusedMoERouter.select_experts``, reached from the runner, which names the layer)
has its ids overwritten the same way; vLLM's padded rows are routed too (the bench's batch sizes are capture sizes).

The engine's scheduler runs in processes of its own: ``route_site/sitecustomize.py`` (on their ``PYTHONPATH``,
with ``MOEPAGE_BENCH_ROUTE`` naming the table) patches SGLang's top-k module, or vLLM's MoE runner module, as it is
imported."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

import torch

ROUTE_ENV = "MOEPAGE_BENCH_ROUTE"
SITE = Path(__file__).with_name("route_site")
TOPK_MODULE = "sglang.srt.layers.moe.topk"
VLLM_RUNNER_MODULE = "vllm.model_executor.layers.fused_moe.runner.moe_runner"
ROW_SPREAD = 64  # a batch's rows start steps / ROW_SPREAD apart in the trace
# name -> bench.analysis.trace_replay key: Qwen3-30B-A3B's per-layer expert heat (llama.cpp decode counts) with
# 0.3 step-to-step reuse, as a token stream (E = 128, top-8: the Qwen3-30B-A3B shapes of the engine bench)
# ("uniform": 48 layers, E = 128, top-8, each step's experts drawn uniformly, no locality)
TRACES = {"qwen3-heat": ("qwen", 0.3, 1, 0, 4096), "uniform": ("uniform", 0, 4096)}


def write_table(trace: str, layers: int, experts: int, top_k: int, path: Path) -> Path:
    """The table of ``trace`` (``TRACES``) for a model of ``layers`` MoE layers, E ``experts`` and ``top_k``."""
    from bench.analysis.trace_replay import make_trace

    t = make_trace(TRACES[trace])
    if (t.num_experts, t.top_k) != (experts, top_k):
        raise ValueError(f"trace {trace!r} routes E={t.num_experts} top-{t.top_k}, the model E={experts} top-{top_k}")
    steps = [t.layers[l * len(t.layers) // layers] for l in range(layers)]
    short = [(l, i) for l, layer in enumerate(steps) for i, s in enumerate(layer) if len(s) != top_k]
    if short:
        raise ValueError(f"trace {trace!r}: {len(short)} steps route fewer than top_k={top_k} distinct experts, "
                         f"first at (layer, step) {short[0]}")
    table = torch.tensor(steps, dtype=torch.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(table, path)
    return path


def write_warm(table: Path, path: Path) -> Path:
    """The table's routing as a ``moepage record`` trace (one step per table step, every MoE layer's ids), for a disk
    tier's ``MOEPAGE_HOST_WARM``: the host tier starts with the experts the replay routes to most (in-sample)."""
    from moepage.planning.traces import save_simple

    ids = torch.load(table)  # [layers, steps, top_k]
    save_simple(path, ids.permute(1, 0, 2).numpy(), int(ids.max()) + 1, ids.shape[2])
    return path


class Replay:
    """Overwrites a MoE layer's routed ids with the table's (module doc)."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layer: int | None = None  # vLLM: the layer whose runner is routing now

    def _state(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on:  # made on the first, eager forward; a capture reuses them
            self._on[device] = (self.table.to(device), torch.zeros((), dtype=torch.long, device=device))
        return self._on[device]

    def route(self, layer_id: int, topk_ids: torch.Tensor, num_token_non_padded: torch.Tensor | None = None) -> None:
        table, forward = self._state(topk_ids.device)
        layers, steps, _ = table.shape
        if layer_id == 0:
            forward += 1
        rows = torch.arange(topk_ids.shape[0], device=topk_ids.device)
        ids = table[layer_id % layers].index_select(0, (rows * max(1, steps // ROW_SPREAD) + forward) % steps)
        if num_token_non_padded is not None:
            ids = ids.masked_fill((rows >= num_token_non_padded)[:, None], -1)
        topk_ids.copy_(ids.to(topk_ids.dtype))


def patch(module, replay: Replay) -> None:
    """``module`` (SGLang's top-k module) routes through ``replay`` after its own ``select_experts``."""
    original = module.select_experts

    def select_experts(*args, **kwargs):
        out = original(*args, **kwargs)
        replay.route(int(kwargs.get("layer_id") or 0), out.topk_ids, kwargs.get("num_token_non_padded"))
        return out

    select_experts.__wrapped__ = original
    module.select_experts = select_experts


def patch_vllm(module, replay: Replay) -> None:
    """``module`` (vLLM's MoE runner module): each runner's router routes through ``replay`` after its own
    ``select_experts``, as the runner's layer (``MoERunner.layer_id``)."""
    from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter

    apply, select = module.MoERunner._apply_quant_method, FusedMoERouter.select_experts

    def _apply_quant_method(self, *args, **kwargs):
        replay.layer = self.layer_id
        try:
            return apply(self, *args, **kwargs)
        finally:
            replay.layer = None

    def select_experts(self, *args, **kwargs):
        weights, ids = select(self, *args, **kwargs)
        if replay.layer is not None:
            replay.route(replay.layer, ids)
        return weights, ids

    _apply_quant_method.__wrapped__, select_experts.__wrapped__ = apply, select
    module.MoERunner._apply_quant_method = _apply_quant_method
    FusedMoERouter.select_experts = select_experts


PATCHES = {TOPK_MODULE: patch, VLLM_RUNNER_MODULE: patch_vllm}  # the module of each engine, and how it is patched


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches an engine's module (``PATCHES``) right after it executes (whoever imports it first)."""

    def __init__(self, replay: Replay, name: str):
        self.replay, self.name = replay, name

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # find the real spec, once
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            PATCHES[name](module, self.replay)

        spec.loader.exec_module = exec_module
        return spec


def install_from_env() -> bool:
    """In an engine process: replay the table ``MOEPAGE_BENCH_ROUTE`` names (False where it names none)."""
    path = os.environ.get(ROUTE_ENV)
    if not path:
        return False
    replay = Replay(torch.load(path))
    for name, patch_module in PATCHES.items():
        if name in sys.modules:
            patch_module(sys.modules[name], replay)
        else:
            sys.meta_path.insert(0, _PatchOnImport(replay, name))
    return True


def child_env(table: Path, env: dict) -> dict:
    """``env`` with the engine's processes replaying ``table``."""
    root = str(Path(__file__).resolve().parents[2])
    path = [str(SITE), root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, ROUTE_ENV: str(table), "PYTHONPATH": os.pathsep.join(path)}
