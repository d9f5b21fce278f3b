"""Next-layer prefetch of paged SGLang layers (``--paged-experts-prefetch``), as ``moepage.wrap``'s ``prefetch=`` for
HF models. SGLang builds and loads layers one at a time, so they are linked once the model is loaded (an AFTER hook of
``DefaultModelLoader.postprocess_weights``, or of ``DummyModelLoader.load_model``), before warm-up and capture: in
``layer_id`` order, each paged layer gets a ``PrefetchLink`` to the next one's pager, routed by the ``gate`` beside that
layer's ``experts`` (Qwen3-MoE, Mixtral, ...); a layer without one is refused by name. Under EP the gate predicts
checkpoint ids: ``LocalExperts`` keeps this rank's. The setting itself is checked at startup (``checks``)."""

from __future__ import annotations

import torch

from ...prefetch import is_router
from .. import linking
from ..linking import no_router
from . import compat
from .method import PagedMoeMethod
from .settings import PREFETCH_WHERE as WHERE


class LocalExperts:
    """A predictor's checkpoint ids as the EP rank's local ids; -1 (ignored by prefetch) for other ranks' experts."""

    def __init__(self, predict, first: int, count: int):
        self.predict, self.first, self.count = predict, first, count

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        ids = self.predict(hidden) - self.first
        return ids.masked_fill((ids < 0) | (ids >= self.count), -1)


def _paged_layers(model: torch.nn.Module):
    """(qualified name, FusedMoE layer, PagedMoeMethod) of every paged layer, in execution order."""
    found = [(n, m, m.quant_method) for n, m in model.named_modules()
             if isinstance(getattr(m, "quant_method", None), PagedMoeMethod)]
    return sorted(found, key=lambda t: getattr(t[1], "layer_id", 0) or 0)  # stable: module order on ties


def _router(modules: dict, qual: str, layer, method) -> torch.nn.Module:
    """The router of the paged ``layer`` named ``qual``: the ``gate`` of the block holding it as ``experts``."""
    parent = modules.get(qual.rpartition(".")[0]) if "." in qual else None
    gate = getattr(parent, "gate", None) if getattr(parent, "experts", None) is layer else None
    if is_router(gate, method.global_experts):
        return gate
    raise no_router(WHERE, method, qual, "beside it (as `experts`) in its block", "Pass --paged-experts-prefetch off")


def _local(nxt):
    """Under EP: the predictor's checkpoint ids as the next layer's rank holds them."""
    method = nxt[2]
    if method.num_experts == method.global_experts:
        return None
    return lambda p: LocalExperts(p, method.first_expert, method.num_experts)


def link_model(model: torch.nn.Module) -> int:
    """Link each paged layer of ``model`` to the next (module docstring); returns how many (0 when off). Idempotent."""
    return linking.link_model(model, _paged_layers, WHERE, lambda modules, nxt: _router(modules, *nxt),
                              lambda nxt: compat.router_top_k(nxt[1]), _local)


def after_postprocess(result, *args, **kwargs):
    """AFTER hook of ``DefaultModelLoader.postprocess_weights(model, target_device)``: link the model's layers."""
    link_model(kwargs["model"] if "model" in kwargs else args[0])
    return result
