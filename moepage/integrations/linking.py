"""Next-layer prefetch across an engine's paged layers: the loop both plugins run once their engine has loaded the
model. Each paged layer's method gets a ``PrefetchLink`` to the next one's pager, routed by the router the engine's
adapter finds for that next layer; every method is then marked linked (its step refuses a prefetch never linked).
Methods carry ``prefetch`` (False, True: the router's own top-k, or M), ``link``, ``prefetch_linked``, ``pager`` and
``global_experts``, as ``sglang.method.PagedMoeMethod`` and ``vllm.method.PagedVllmMethod`` do."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..errors import ConfigError
from ..prefetch import Predictor, router_link

Paged = tuple[str, torch.nn.Module, object]  # (qualified name, the engine's layer, its paged method)


def link_layers(layers: Sequence[Paged], where: str, router: Callable[[Paged], torch.nn.Module],
                top_k: Callable[[Paged], int],
                local: Callable[[Paged], Callable[[Predictor], Predictor] | None]) -> int:
    """Link each of ``layers`` (in execution order) to the next; ``router``, ``top_k`` and ``local`` (a predictor's
    ids as the next layer's rank holds them, or None) read the next layer. Returns how many (0 when off)."""
    wanted = {m.prefetch for _, _, m in layers}
    if not any(wanted):
        return 0
    if len(wanted) > 1:
        raise ConfigError(f"{where}: the paged layers of one model were built with different settings "
                          f"{sorted(map(str, wanted))}")
    made = 0
    for (_, _, method), nxt in zip(layers, layers[1:]):
        top = method.prefetch if method.prefetch is not True else top_k(nxt)
        nxt_method = nxt[2]
        method.link = router_link(nxt_method.pager, router(nxt), top, nxt_method.global_experts, where, local(nxt))
        made += 1
    for _, _, method in layers:
        method.prefetch_linked = True
    return made


def link_model(model: torch.nn.Module, layers: Callable[[torch.nn.Module], Sequence[Paged]], where: str,
               router: Callable[[dict, Paged], torch.nn.Module], top_k: Callable[[Paged], int],
               local: Callable[[Paged], Callable[[Predictor], Predictor] | None]) -> int:
    """``link_layers`` over ``model``'s paged ``layers(model)``, ``router`` reading the model's modules by name;
    returns how many it linked (0 when off). Idempotent."""
    modules = dict(model.named_modules())
    return link_layers(layers(model), where, lambda nxt: router(modules, nxt), top_k, local)


def no_router(where: str, method, qual: str, place: str, instead: str) -> ConfigError:
    """The refusal of a paged layer (``qual``) whose router the adapter found nowhere (``place``: where it looked)."""
    return ConfigError(f"{where}: layer {method.layer_key} ({qual}): no router to predict its experts with; prefetch "
                       f"needs a `gate` with a 2-D weight [E={method.global_experts}, H] {place}. {instead}")


def refuse_unlinked(method, where: str, linker: str, instead: str) -> None:
    """Refuse a step of ``method`` whose prefetch is on but whose layers were never linked (``linker``: when the
    engine's hook links them; ``instead``: what to pass)."""
    if method.prefetch and not method.prefetch_linked:
        raise ConfigError(f"layer {method.layer_key}: {where} is on but the layers were never linked: moepage links "
                          f"them {linker}, which this load did not run; {instead}")
