"""Next-layer expert prefetch (issue 15): while layer L runs, page the experts predicted for layer
L+1 into L+1's slots, so that L+1's step pages in only what the prediction missed.

Owns:

- ``Predictor``: hidden states ``[T, H]`` entering layer L's experts -> predicted expert ids of
  layer L+1, ``[T, m]`` (ids < 0 or >= E ignored); ``RouterPredictor``, the default: L+1's
  router applied to that state, top-m (fixed shapes, capturable).
- ``Prefetcher``: the prefetch of one layer, composed by its ``LayerPager``. A prefetch is one
  wave of at most K of the predicted experts, placed by the policy's rule exactly as a real wave
  (wave 0 of a step routing those ids: resident ones first), so the host ``Residency`` and the
  device planner stay identical. Routing is never changed: a prediction only changes residency and
  when copies happen, so outputs are the unpaged model's whatever it predicts.

  * Device state (device planner): planned on the current stream into the layer's separate
    prefetch plan buffers (the steps' counters stay the critical-path figures), then gathered on
    the pager's side stream as a background copy, after everything enqueued so far; an event
    marks it pending. Every reader of the layer's slots or state (its next step, ``check_slots``,
    ``residency``, unwrap) first makes the current stream wait for that event: no host sync, and
    inside a CUDA-graph capture this joins the side stream back into the capture. On the CPU the
    gather runs at once and nothing is pending.
  * Host planner: placed on the host and paged in at once (a host sync on CUDA, so never inside a
    capture; the pager refuses that).

- ``PrefetchLink``: (successor pager, predictor), what a step of layer L calls after its first
  wave's page-in is issued (the pager's ``after_page_in`` hook); ``links`` resolves ``wrap``'s
  ``prefetch=`` argument into them, every check before anything is allocated.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

from .errors import ConfigError
from .residency import Residency, Wave, resident_first

if TYPE_CHECKING:
    from .pager import LayerPager

Predictor = Callable[[Tensor], Tensor]  # hidden [T, H] entering layer L's experts -> ids [T, m] of layer L+1


class RouterPredictor:
    """Layer L+1's router on the hidden state entering layer L's experts: ``topk(linear(hidden,
    weight, bias), top).indices``. ``weight`` ``[E, H]``; ``top`` = m, the experts predicted per
    token."""

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
    """A ``RouterPredictor`` over a router module's weight (and bias) as they are at each call: a
    loader may replace the module's parameters after ``wrap`` (moepage's HF loader does)."""

    def __init__(self, router: torch.nn.Module, top: int):
        self.router, self.top = router, top

    def __call__(self, hidden: Tensor) -> Tensor:
        bias = self.router._parameters.get("bias")
        return RouterPredictor(self.router._parameters["weight"], self.top, bias)(hidden)


def prefetch_wave(res: Residency, distinct: Sequence[int]) -> Wave:
    """Place the distinct experts ``distinct`` (ascending) as one prefetch wave on the host: at
    most K, the resident ones first, as wave 0 of a step routing them (``kernels.planner.step_ranks``)."""
    return res.place(resident_first(res, distinct)[: res.num_slots])


class Prefetcher:
    """The prefetch of one layer: plans one wave of predicted experts and pages it in early."""

    def __init__(self, pager: "LayerPager"):
        self.pager = pager
        self.pending: torch.cuda.Event | None = None  # the side-stream page-in not yet awaited
        self.pending_captured = False  # whether it was recorded inside a CUDA-graph capture

    def wait(self) -> None:
        """Order the current stream after the pending page-in, if any (no host sync)."""
        if self.pending is None:
            return
        from .pager import capturing  # not at the top: the pager module imports this one
        # An event recorded before a capture began cannot be waited for inside it; torch.cuda.graph
        # synchronises the device when a capture begins, so that page-in has completed.
        if self.pending_captured or not capturing():
            torch.cuda.current_stream(self.pager.device).wait_event(self.pending)
        self.pending = None

    def prefetch(self, ids: Tensor) -> None:
        """Place the experts of ``ids`` as one prefetch wave and page the missing ones in."""
        self.wait()  # the previous prefetch still reads the plan buffers this one overwrites
        pager = self.pager
        ids = ids.to(pager.device)
        state = pager.device_state
        if state is None:
            wave = prefetch_wave(pager.host, pager._read_state(ids))  # a sync on CUDA
            pager.page_in(wave.loads, prefetch=True)
            return
        state.plan_prefetch(ids)  # on the current stream: the table stays in order with every step
        if pager.device.type != "cuda":
            pager._gather(state.prefetch_plan, background=True)
        else:
            # The side stream waits for everything enqueued so far: the slots' earlier readers, the
            # plan, and the running step's own page-in, which it must not delay.
            current = torch.cuda.current_stream(pager.device)
            side = pager.copy_stream()
            side.wait_stream(current)
            pager._gather(state.prefetch_plan, background=True, side=side)
            event = torch.cuda.Event()
            event.record(side)
            self.pending, self.pending_captured = event, torch.cuda.is_current_stream_capturing()


@dataclass
class PrefetchLink:
    """What layer L's step calls once its first wave's page-in is issued: predict layer L+1's
    experts from the hidden state entering L's experts and prefetch them into ``target``."""

    target: "LayerPager"
    predictor: Predictor

    def __post_init__(self) -> None:
        if self.target.device_state is not None and self.target.device.type == "cuda":
            self.target.copy_stream()  # now, not first inside a capture

    def after_page_in(self, hidden: Tensor) -> Callable[[], None]:
        """The pager hook (``after_page_in``) that issues this prefetch from ``hidden``."""
        return lambda: self(hidden)

    def __call__(self, hidden: Tensor) -> None:
        if not self.target.released:  # its layer was unwrapped on its own
            self.target.prefetch(self.predictor(hidden))


# -- wrap's prefetch= ----------------------------------------------------------------------------
def _router_of(
    name: str, experts: torch.nn.Module, parent: torch.nn.Module | None, num_experts: int
) -> torch.nn.Module:
    """The router beside an experts module: its parent's one other child with a 2-D ``weight``
    of E rows (HF Qwen3-MoE / Mixtral / OLMoE ``gate``, the toy's ``router``)."""
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
    """Resolve ``wrap``'s ``prefetch=`` into ``{i: predictor}``: run on the hidden state entering
    layer i's experts, predicting layer i+1's (``layers``: (name, qualified name, module, E,
    top_k) of each experts module, in execution order). ``False`` / ``None``: off; ``True``: each
    next layer's router, top_k per token; an int m >= 1: its router, top-m; a mapping {experts
    module name: Predictor} for custom predictors. Raises ``ConfigError`` on anything else."""
    if prefetch is None or prefetch is False:
        return {}
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
    top: int | None = None
    if prefetch is not True:
        try:
            top = operator.index(prefetch)  # type: ignore[arg-type]
        except TypeError:
            top = 0
        if top < 1:
            raise ConfigError(
                f"prefetch={prefetch!r}: use True (the next layer's router, its top_k), an int m >= 1 "
                "(router top-m), a {experts module name: predictor} mapping, or False"
            )
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
