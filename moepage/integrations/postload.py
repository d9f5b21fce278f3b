"""The post-load step of a paged layer: the base method's ``process_weights_after_loading`` run as without paging,
over K-row tensors. ``keep_layout`` (runners reading the checkpoint layout) runs it on slots holding experts 0..K-1,
which it must leave as loaded. ``repack`` (GPTQ/AWQ Marlin) runs it over the staged rows K experts at a time, each
chunk from the layer state before the first, then over experts 1..K to check that it treats every expert on its own.
A step paging cannot reproduce (transforming, adding or mixing per-expert tensors) is refused by tensor name. Engine
neutral: ``per_expert(layer, k)`` names the layer's per-expert tensors as its engine finds them."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..backends.protocol import RowSpec
from ..bits import same_bits
from ..errors import ConfigError

PerExpert = Callable[[torch.nn.Module, int], "tuple[str, ...] | list[str]"]

_MODULE_ATTRS = frozenset(vars(torch.nn.Module()))


def _state(layer) -> dict:
    return {k: v for k, v in vars(layer).items() if k not in _MODULE_ATTRS}


def _restore(layer, state: dict) -> None:
    for k in [k for k in vars(layer) if k not in _MODULE_ATTRS and k not in state]:
        delattr(layer, k)
    for k, v in state.items():
        setattr(layer, k, v)


def keep_layout(layer, base_method, names, host: Callable[[str], torch.Tensor], slots: Callable[[str], torch.Tensor],
                k: int, per_expert: PerExpert) -> None:
    """Run the base step on slots holding experts 0..K-1; check it left them as loaded."""
    before = {n: getattr(layer, n) for n in names}
    for n in names:
        slots(n).copy_(host(n)[:k])
    base_method.process_weights_after_loading(layer)
    label = type(base_method).__name__
    added = set(per_expert(layer, k)) - set(names)
    if added:
        raise ConfigError(f"moepage: {label}'s post-load step creates per-expert {sorted(added)}, "
                          "which the host rows do not hold")
    for n in names:
        p = getattr(layer, n)
        if p.data_ptr() == slots(n).data_ptr():
            continue
        # Rebound (e.g. copy_or_rebind_param): fine if it is the same rows, which we re-point.
        if (p.shape != slots(n).shape or p.dtype != slots(n).dtype
                or not same_bits(host(n)[:k], p.data)):
            raise ConfigError(f"moepage: {label}'s post-load step transforms {n}, which paging cannot reproduce")
        p.data = slots(n)
        if p is not before[n]:
            before[n].data = slots(n)
    for n in names:
        if not same_bits(host(n)[: min(k, 1)], slots(n)[: min(k, 1)]):
            raise ConfigError(f"moepage: {label}'s post-load step transforms {n} in place, "
                              "which paging cannot reproduce")


def repack(
    layer,
    base_method,
    staged: Mapping[str, torch.Tensor],
    k: int,
    unpaged: tuple[str, ...],
    allocate: Callable[[dict[str, RowSpec]], Callable[[str], torch.Tensor]],
    per_expert: PerExpert,
) -> list[str]:
    """Run the base step over ``staged`` (name -> [E, ...] checkpoint rows) K experts at a time; returns the repacked
    names (the caller points the layer's tensors at the slots). ``allocate(specs)`` is called once, with the repacked
    tensors' row specs, and returns ``host(name)``: the [E, ...] host rows to fill."""
    e = next(iter(staged.values())).shape[0]
    templates = {n: getattr(layer, n) for n in staged}
    state = _state(layer)
    label = type(base_method).__name__

    def post_load(start: int, n: int) -> None:
        _restore(layer, state)
        for name, template in templates.items():
            fresh = torch.nn.Parameter(template.data.clone(), requires_grad=False)
            fresh.__dict__.update(template.__dict__)
            fresh.data[:n].copy_(staged[name][start : start + n])
            if n < k:  # a short last chunk: real experts, never uninitialised memory
                fresh.data[n:].copy_(staged[name][: k - n])
            layer.register_parameter(name, fresh)
        base_method.process_weights_after_loading(layer)

    host = None
    names: list[str] = []
    for start in range(0, e, k):
        n = min(k, e - start)
        post_load(start, n)
        if host is None:
            names = [m for m in per_expert(layer, k) if m not in unpaged]
            if not names:
                raise ConfigError(f"moepage: {label} leaves no per-expert tensors after loading")
            specs = {m: RowSpec(tuple(getattr(layer, m).shape[1:]), getattr(layer, m).dtype) for m in names}
            host = allocate(specs)
        for m in names:
            host(m)[start : start + n].copy_(getattr(layer, m).data[:n])
    if e > k:
        post_load(1, k)
        for m in names:
            if not same_bits(host(m)[1 : k + 1], getattr(layer, m).data):
                raise ConfigError(
                    f"moepage: {label}'s post-load step does not treat each expert on its own ({m}), "
                    "so it cannot run K experts at a time"
                )
    return names
