"""``wrap``'s ``prefetch=``: each paged layer's router found beside its experts module, every check before anything
is allocated. The prefetch itself is the core's (``moepage.prefetch``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from ..config import parse_prefetch
from ..errors import ConfigError
from ..prefetch import ModuleRouter, Predictor


def _router_of(
    name: str, experts: torch.nn.Module, parent: torch.nn.Module | None, num_experts: int
) -> torch.nn.Module:
    """The router beside an experts module: its parent's one other child with a 2-D ``weight`` of E rows."""
    found = [
        (n, child) for n, child in (parent.named_children() if parent is not None else ())
        if child is not experts
        and isinstance(w := child._parameters.get("weight"), Tensor) and w.dim() == 2 and w.shape[0] == num_experts
    ]
    if len(found) != 1:
        what = "none" if not found else "several: " + ", ".join(n for n, _ in found)
        raise ConfigError(
            f"layer {name}: prefetch needs this layer's router, a module beside its experts with a 2-D "
            f"weight [E={num_experts}, H]; found {what}. Pass prefetch={{{name!r}: predictor}} with a "
            "predictor for every layer to prefetch (a callable: hidden [T, H] -> expert ids [T, m])"
        )
    return found[0][1]


def links(
    prefetch: object,
    root: torch.nn.Module,
    layers: Sequence[tuple[str, str, torch.nn.Module, int, int | None]],
) -> dict[int, Predictor]:
    """``wrap``'s ``prefetch=`` as ``{i: predictor of layer i+1 from layer i's input}`` (``layers``:
    (name, qualified name, module, E, top_k) in execution order): off, ``True`` (the router's
    top_k), an int m (top-m) or ``{experts module name: Predictor}``; else a ``ConfigError``."""
    names = [name for name, *_ in layers]
    if isinstance(prefetch, Mapping):
        unknown = [key for key in prefetch if key not in names[1:]]
        if unknown:
            raise ConfigError(
                f"prefetch: keys {unknown} name no experts module after the first; a predictor for layer X runs in "
                f"the layer before X, so the keys are among {names[1:]}"
            )
        bad = [key for key, p in prefetch.items() if not callable(p)]
        if bad:
            raise ConfigError(f"prefetch: the values for {bad} are not callables (hidden [T, H] -> expert ids [T, m])")
        return {names.index(key) - 1: p for key, p in prefetch.items()}
    try:
        chosen = parse_prefetch(prefetch)
    except ValueError:
        raise ConfigError(
            f"prefetch={prefetch!r}: use True (the next layer's router, its top_k), an int m >= 1 "
            "(router top-m), a {experts module name: predictor} mapping, or False"
        ) from None
    if chosen is False:
        return {}
    top = None if chosen is True else chosen
    parents = dict(root.named_modules())
    out: dict[int, Predictor] = {}
    for i, (name, qual, module, e, top_k) in enumerate(layers[1:]):
        parent = parents.get(qual.rpartition(".")[0]) if qual else None
        router = _router_of(name, module, parent, e)
        m = top if top is not None else getattr(router, "top_k", top_k)
        if not isinstance(m, int) or not 1 <= m <= e:
            raise ConfigError(
                f"layer {name}: prefetch={prefetch!r} predicts {m!r} experts per token; need 1..E={e} "
                "(pass an int m, or top_k=)"
            )
        out[i] = ModuleRouter(router, m)
    return out
