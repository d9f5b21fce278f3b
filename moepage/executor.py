"""One paged step of an HF-style experts module: plan -> page-in -> run on slots -> merge -> reduce.

``PagedLayer`` is what ``wrap`` attaches to an experts module; its ``forward`` replaces the
module's. Steps of at most K routed entries are planned and paged on the device when the store
can (``LayerPager.device_slots``); others are split into waves on the host
(``LayerPager.host_waves``). Each wave runs the module's own forward over its entries with routed
ids remapped to slot ids (``runners``), writes each entry into one merged buffer, and the buffer is
reduced as the unpaged layer would. A single wave writes no merge buffer: its output already is it.
"""

from __future__ import annotations

import torch

from .errors import ConfigError
from .pager import LayerPager
from .telemetry import LayerStats
from .residency import Wave
from .runners import ExpertsForward, runner_for
from .store import PagedExpertStore, RowSpec

__all__ = ["LayerStats", "PagedLayer", "attach", "paged_layer"]


class PagedLayer(LayerPager):
    """Paging state and step of one experts module."""

    def __init__(
        self,
        name: str,
        module: torch.nn.Module,
        store: PagedExpertStore,
        specs: dict[str, RowSpec],
        num_experts: int,
        num_slots: int,
        top_k: int | None,
        runner: str | None,
        verify: bool,
        original_forward: ExpertsForward,
        device_planner: bool | None = None,
        prefill_overlap: bool = False,
    ):
        super().__init__(name, store, specs, num_experts, num_slots, verify, device_planner, prefill_overlap)
        self.module_ref = module
        self.top_k = top_k
        self.runner = runner
        self.original_forward = original_forward
        self.original_device = module._parameters[next(iter(specs))].device

    def __repr__(self) -> str:
        s = self.stats
        return (f"PagedLayer({self.name}: K={self.num_slots} of E={self.num_experts} experts resident, "
                f"{self.store.name} store, {s.steps} steps, hit rate {s.hit_rate:.1%})")

    @torch.no_grad()
    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        self._check_step(top_k_index)
        e = self.num_experts
        t, k = top_k_index.shape
        device = hidden.device
        runner = runner_for(self.module_ref, self.runner)
        valid = (top_k_index >= 0) & (top_k_index < e)
        rank = runner.tie_rank(top_k_index)  # the unpaged tie order, for runners that sort ids
        tokens = runner.entry_tokens(t, k, device)
        wdtype = top_k_weights.dtype
        if self.plans_on_device(t, k, device.type == "cuda"):
            # Padding goes to slot id K, the sentinel an HF-style implementation skips.
            slots = runner.entries(self.device_slots(top_k_index, pad=self.num_slots, valid=valid))
            merged = runner.run(self.original_forward, hidden, None, tokens, slots, wdtype, rank)
            return runner.reduce(merged, top_k_index, top_k_weights, valid, hidden.dtype)

        distinct = torch.unique(top_k_index[valid]).tolist()  # the host plan needs them
        # Padding maps to index E, whose slot is -1: never computed, never paged.
        flat_ids = runner.entries(torch.where(valid, top_k_index, e))
        whole = bool(valid.all())
        merged = None

        def run_wave(wave: Wave, to_slot: torch.Tensor, count: int) -> None:
            nonlocal merged
            slots = to_slot[flat_ids]
            if count == 1 and whole:
                merged = runner.run(self.original_forward, hidden, None, tokens, slots, wdtype, rank)
                return
            rows = (slots >= 0).nonzero().squeeze(1)
            out = runner.run(self.original_forward, hidden, rows, tokens, slots, wdtype, rank)
            if merged is None:
                merged = torch.zeros(t * k, hidden.shape[-1], dtype=out.dtype, device=device)
            merged[rows] = out

        self.host_waves(distinct, run_wave)
        if merged is None:  # nothing routed: every entry is padding
            merged = torch.zeros(t * k, hidden.shape[-1], dtype=hidden.dtype, device=device)
        return runner.reduce(merged, top_k_index, top_k_weights, valid, hidden.dtype)

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
