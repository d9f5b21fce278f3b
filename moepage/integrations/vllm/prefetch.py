"""Next-layer prefetch of paged vLLM layers (the ``prefetch`` option), as SGLang's: vLLM builds and loads the layers
one at a time, so they are linked once its loader has loaded the model (``BaseModelLoader.load_model``, wrapped in
``compat.HOOKS``), before warm-up and capture: in module order, each paged layer gets a ``PrefetchLink`` to the next
one's pager, routed by the next layer's gate: its runner's own (``MoERunner.gate``, as Qwen3-MoE builds it) or the
``gate`` beside the runner in its block (Mixtral); a layer without one is refused by name. Under EP the gate predicts
global ids; the next layer's expert map keeps that rank's (other ranks' experts: -1, ignored)."""

from __future__ import annotations

import torch

from ...prefetch import is_router
from .. import linking
from ..linking import no_router
from .method import PagedVllmMethod
from .settings import OPTIONS

WHERE = OPTIONS["prefetch"].flag


class MappedExperts:
    """A predictor's global ids through a layer's expert map (global -> local, -1 for other ranks)."""

    def __init__(self, predict, expert_map: torch.Tensor):
        self.predict, self.expert_map = predict, expert_map

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.expert_map[self.predict(hidden)]


def _paged_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, PagedVllmMethod]]:
    """(qualified name, RoutedExperts, PagedVllmMethod) of every paged layer, in module (execution) order."""
    return [(n, m, m.quant_method) for n, m in model.named_modules()
            if isinstance(getattr(m, "quant_method", None), PagedVllmMethod)]


def _router(modules: dict, qual: str, method: PagedVllmMethod) -> torch.nn.Module:
    """The gate routing the paged layer named ``qual`` (a runner's ``routed_experts``)."""
    runner_name = qual.rpartition(".")[0]
    runner = modules.get(runner_name)
    block = modules.get(runner_name.rpartition(".")[0])
    for gate in (getattr(runner, "gate", None), getattr(block, "gate", None)):
        if is_router(gate, method.global_experts):
            return gate
    raise no_router(WHERE, method, qual, "on its runner or beside it in its block", "Serve with prefetch off")


def _local(nxt):
    """Under EP: the predictor's global ids as the next layer's rank holds them (its expert map)."""
    emap = nxt[1].expert_map
    return None if emap is None else lambda p: MappedExperts(p, emap)


def link_model(model: torch.nn.Module) -> int:
    """Link each paged layer of ``model`` to the next (module docstring); returns how many (0 when off). Idempotent."""
    return linking.link_model(model, _paged_layers, WHERE, lambda modules, nxt: _router(modules, nxt[0], nxt[2]),
                              lambda nxt: nxt[2].top_k, _local)
