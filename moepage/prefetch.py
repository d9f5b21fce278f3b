"""Next-layer expert prefetch: while layer L runs, page the experts predicted for layer L+1 into
its slots, so that L+1's step pages in only what the prediction missed.

A ``Predictor`` maps the hidden states entering L's experts ``[T, H]`` to L+1's ids ``[T, m]``
(``RouterPredictor``: L+1's router, top-m, capturable). A ``PrefetchLink`` is what L's step calls
after its first page-in; ``prefetch`` places one wave of at most K in L+1 by the policy's rule.
Routing never changes, so outputs are the unpaged model's whatever is predicted. An adapter finds
each layer's router (``nn.prefetch`` for torch modules, ``integrations.sglang.prefetch``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from . import capture
from .errors import ConfigError
from .pager import LayerPager
from .residency import prefetch_wave

Predictor = Callable[[Tensor], Tensor]  # hidden [T, H] entering layer L's experts -> ids [T, m] of layer L+1


class RouterPredictor:
    """``topk(linear(hidden, weight [E, H], bias), top).indices``: layer L+1's router on L's input."""

    def __init__(self, weight: Tensor, top: int, bias: Tensor | None = None):
        if weight.dim() != 2:
            raise ConfigError(f"RouterPredictor: weight must be [E, H], got shape {tuple(weight.shape)}")
        if not 1 <= top <= weight.shape[0]:
            raise ConfigError(f"RouterPredictor: top={top} is outside 1..E={weight.shape[0]}")
        self.weight, self.top, self.bias = weight, top, bias

    def __call__(self, hidden: Tensor) -> Tensor:
        logits = F.linear(hidden.to(self.weight.dtype), self.weight, self.bias)
        return torch.topk(logits, self.top, dim=-1).indices


class ModuleRouter:
    """A ``RouterPredictor`` over a router module's parameters as they are at each call (a loader
    may replace them after ``wrap``)."""

    def __init__(self, router: torch.nn.Module, top: int):
        self.router, self.top = router, top

    def __call__(self, hidden: Tensor) -> Tensor:
        bias = self.router._parameters.get("bias")
        return RouterPredictor(self.router._parameters["weight"], self.top, bias)(hidden)


@dataclass
class PrefetchLink:
    """Layer L's step hook: predict L+1's experts from L's input and prefetch them into ``target``."""

    target: LayerPager
    predictor: Predictor

    def __post_init__(self) -> None:
        if self.target.device_state is not None and self.target.device.type == "cuda":
            self.target.copy_stream()  # now, not first inside a capture

    def after_page_in(self, hidden: Tensor) -> Callable[[], None]:
        """The pager hook (``after_page_in``) that issues this prefetch from ``hidden``."""
        return lambda: self(hidden)

    def __call__(self, hidden: Tensor) -> None:
        if not self.target.released:  # its layer was unwrapped on its own
            prefetch(self.target, self.predictor(hidden))


def is_router(module: object, num_experts: int) -> bool:
    """Whether ``module`` can predict a layer's experts: a 2-D weight ``[E, H]`` for its E (a gate, as models build)."""
    weight = getattr(module, "weight", None)
    return isinstance(weight, Tensor) and weight.dim() == 2 and weight.shape[0] == num_experts


def router_link(target: LayerPager, router: torch.nn.Module, top: object, num_experts: int, where: str,
                local: Callable[[Predictor], Predictor] | None = None) -> PrefetchLink:
    """A ``PrefetchLink`` into ``target`` predicted by ``router`` (its top-``top`` of E = ``num_experts``; ``local``
    wraps the predictor where the next layer holds part of the experts), as the engine plugins link their layers."""
    if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= num_experts:
        raise ConfigError(f"{where}: layer {target.name} would predict {top!r} experts per token; "
                          f"need 1..E={num_experts}")
    predict: Predictor = ModuleRouter(router, top)
    return PrefetchLink(target, predict if local is None else local(predict))


def prefetch(pager: LayerPager, ids: Tensor) -> None:
    """Page in the experts predicted for ``pager``'s next step (``ids``, any shape; invalid ids ignored) as one wave of
    at most K by the policy's rule, counted as ``prefetched``. Device state: planned on the current stream, gathered
    on the copy stream (no host sync). Host state: paged in at once."""
    state = pager.device_state
    if state is None and capture.capturing():
        raise ConfigError(
            f"layer {pager.name}: a prefetch inside a CUDA graph capture needs the device planner "
            f"(the {pager.store.name} store, device_planner={pager.config.device_planner} plans on the host)"
        )
    pager.settle()
    pager.await_prefetch()  # the previous one still reads the plan buffers this one overwrites
    ids = ids.to(pager.device)
    pager.begin_write()  # the plan changes the state before its rows are in (the gather or page-in ends it)
    if state is None:
        pager.page_in(prefetch_wave(pager.residency, pager.read_state(ids)).loads, prefetch=True)
        pager.end_write()
    elif pager.device.type != "cuda":
        state.plan_prefetch(ids)
        pager.gather(state.prefetch_plan, background=True)
    else:
        state.plan_prefetch(ids)  # on the current stream: the table stays in order with every step
        side = pager.copy_stream()
        side.wait_stream(torch.cuda.current_stream(pager.device))  # the slots' readers, the plan, the step's page-in
        pager.gather(state.prefetch_plan, background=True, side=side)
        pager.pending_after(side)
    if pager.config.verify and not capture.capturing():
        pager.check_slots()
