"""One paged step of an HF-style experts module: plan -> page-in -> run on slots -> merge -> reduce.

``PagedLayer`` is what ``wrap`` attaches to an experts module; its ``forward`` replaces the
module's. It composes the layer's ``LayerPager`` (residency, store, counters) with the module's
runner (``runners``):

- ``device_forward`` is the step as a CUDA graph captures it: plan, gather, slot lookup, compute
  and reduce from device state alone, in ⌈min(E, entries) / K⌉ waves fixed by the shapes. Tests
  call it directly; ``forward`` takes it for steps of at most K routed entries, and for any step
  while a graph is being captured.
- ``host_forward`` plans on the host (eager steps of more than K entries): each wave runs the
  module's own forward over its entries with routed ids remapped to slot ids.

With ``prefetch`` set (a ``prefetch.PrefetchLink`` to the next paged layer), either step issues
that layer's prefetch from the hidden state it was given, once its own first wave's page-in is
enqueued and before that wave computes, so the prefetch overlaps this layer's compute.

A single wave whose runner is ``direct`` is the module's own forward on slot ids; otherwise each
entry is written into one merged buffer by the one wave that holds its expert, and the buffer is
reduced as the unpaged module would.
"""

from __future__ import annotations

import torch

from .errors import ConfigError
from .pager import AfterPageIn, LayerPager
from .prefetch import PrefetchLink
from .residency import Residency, Wave
from .runners import ExpertsForward, Runner
from .telemetry import LayerStats

__all__ = ["LayerStats", "PagedLayer", "attach", "paged_layer"]


class PagedLayer:
    """Paging state and step of one experts module."""

    def __init__(self, pager: LayerPager, module: torch.nn.Module, runner: Runner, original_forward: ExpertsForward):
        self.pager = pager
        self.module_ref = module
        self.runner = runner
        self.original_forward = original_forward
        self.original_device = module._parameters[next(iter(pager.specs))].device
        self.prefetch: PrefetchLink | None = None  # the next paged layer's prefetch, issued by each step

    # What wrap, unwrap and stats read, from the pager.
    name = property(lambda self: self.pager.name)
    store = property(lambda self: self.pager.store)
    specs = property(lambda self: self.pager.specs)
    num_experts = property(lambda self: self.pager.num_experts)
    num_slots = property(lambda self: self.pager.num_slots)
    device = property(lambda self: self.pager.device)

    @property
    def stats(self) -> LayerStats:
        return self.pager.stats

    @property
    def residency(self) -> Residency:
        return self.pager.residency

    def check_slots(self) -> None:
        self.pager.check_slots()

    def __repr__(self) -> str:
        s = self.stats
        return (f"PagedLayer({self.name}: K={self.num_slots} of E={self.num_experts} experts resident, "
                f"{self.store.name} store, {s.steps} steps, hit rate {s.hit_rate:.1%})")

    @torch.no_grad()
    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        self._check_step(top_k_index)
        if self.pager.plans_on_device(top_k_index.numel()):
            return self.device_forward(hidden, top_k_index, top_k_weights)
        return self.host_forward(hidden, top_k_index, top_k_weights)

    @torch.no_grad()
    def device_forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The captured step: reads and writes device state only, never synchronises."""
        pager, runner = self.pager, self.runner
        pad = pager.num_slots  # the sentinel slot id an HF-style implementation skips
        if pager.device_wave_count(top_k_index.numel()) == 1 and runner.direct(hidden.device):
            out: list[torch.Tensor] = []
            pager.device_waves(
                top_k_index, pad, lambda slots, w, n: out.append(self.original_forward(hidden, slots, top_k_weights)),
                after_page_in=self._after_page_in(hidden),
            )
            return out[0]
        t, k = top_k_index.shape
        valid = (top_k_index >= 0) & (top_k_index < pager.num_experts)
        rank = runner.tie_rank(top_k_index)  # the unpaged tie order, for runners that need it
        tokens = runner.entry_tokens(t, k, hidden.device)
        skip = runner.skip_slot(pager.num_slots)
        merged: torch.Tensor | None = None

        def run_wave(slots: torch.Tensor, w: int, n: int) -> None:
            nonlocal merged
            flat = runner.entries(slots)
            mine = flat >= 0  # this wave's entries; the others' results are dropped
            if runner.syncs:  # the module synchronises anyway: run this wave's rows alone
                rows = mine.nonzero().squeeze(1)
                out = runner.run(self.original_forward, hidden, rows, tokens, flat, top_k_weights.dtype, rank)
                if merged is None:
                    merged = out.new_zeros(t * k, out.shape[-1])
                merged[rows] = out
                return
            out = runner.run(self.original_forward, hidden, None, tokens, torch.where(mine, flat, skip),
                             top_k_weights.dtype, rank)
            merged = out if merged is None else torch.where(mine[:, None], out, merged)

        pager.device_waves(top_k_index, -1, run_wave, after_page_in=self._after_page_in(hidden))
        assert merged is not None
        return runner.reduce(merged, top_k_index, top_k_weights, valid, hidden.dtype)

    @torch.no_grad()
    def host_forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """A step planned on the host, in as many waves as its distinct experts need."""
        pager, runner = self.pager, self.runner
        e, pad = pager.num_experts, pager.num_slots
        t, k = top_k_index.shape
        device = hidden.device
        valid = (top_k_index >= 0) & (top_k_index < e)
        ids = torch.where(valid, top_k_index, e)  # padding: index E, whose slot is -1
        flat_ids = runner.entries(ids)
        rank = runner.tie_rank(top_k_index)
        tokens = runner.entry_tokens(t, k, device)
        result: torch.Tensor | None = None  # the module's own output (one direct wave)
        merged: torch.Tensor | None = None

        def run_wave(wave: Wave, to_slot: torch.Tensor, count: int) -> None:
            nonlocal result, merged
            if count == 1 and not runner.syncs:  # every routed entry is in this wave: only padding is left out
                if runner.direct(device):
                    result = self.original_forward(hidden, to_slot.masked_fill(to_slot < 0, pad)[ids], top_k_weights)
                else:
                    slots = to_slot.masked_fill(to_slot < 0, runner.skip_slot(pad))[flat_ids]
                    merged = runner.run(self.original_forward, hidden, None, tokens, slots, top_k_weights.dtype, rank)
                return
            slots = to_slot[flat_ids]
            rows = (slots >= 0).nonzero().squeeze(1)
            out = runner.run(self.original_forward, hidden, rows, tokens, slots, top_k_weights.dtype, rank)
            if merged is None:
                merged = torch.zeros(t * k, hidden.shape[-1], dtype=out.dtype, device=device)
            merged[rows] = out

        pager.host_waves(top_k_index, run_wave, after_page_in=self._after_page_in(hidden))
        if result is not None:
            return result
        if merged is None:  # nothing routed: every entry is padding
            merged = torch.zeros(t * k, hidden.shape[-1], dtype=hidden.dtype, device=device)
        return runner.reduce(merged, top_k_index, top_k_weights, valid, hidden.dtype)

    def _after_page_in(self, hidden: torch.Tensor) -> AfterPageIn | None:
        return None if self.prefetch is None else self.prefetch.after_page_in(hidden)

    def _check_step(self, top_k_index: torch.Tensor) -> None:
        if top_k_index.dim() != 2:
            raise ConfigError(
                f"layer {self.name}: top_k_index must be [tokens, top_k], got shape {tuple(top_k_index.shape)}"
            )
        k = top_k_index.shape[1]
        if k > self.num_slots:
            raise ConfigError(
                f"layer {self.name}: routing selects top_k={k} experts per token but only "
                f"resident={self.num_slots} slots exist; need resident >= top_k"
            )
        for name in self.specs:
            param = self.module_ref._parameters.get(name)
            if param is None or param.data_ptr() != self.store.slots(self.name, name).data_ptr():
                raise ConfigError(
                    f"layer {self.name}: parameter {name!r} no longer is moepage's slot table "
                    "(was the model moved with .to() / .half() after wrap?). Pass device= to "
                    "moepage.wrap instead, or unwrap first."
                )


def attach(module: torch.nn.Module, layer: PagedLayer) -> None:
    """Route ``module``'s forward through ``layer``."""
    module._moepage = layer  # type: ignore[attr-defined]
    module.forward = layer.forward  # type: ignore[method-assign]


def paged_layer(module: torch.nn.Module) -> PagedLayer | None:
    return getattr(module, "_moepage", None)
