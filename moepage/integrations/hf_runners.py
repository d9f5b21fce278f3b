"""Hugging Face transformers' experts implementations as moepage runners.

Registered through the ``moepage.runners`` entry point (``register``), so ``moepage.wrap`` of an HF
model follows its ``config._experts_implementation`` without importing transformers:

- ``eager`` (the per-expert loop with ``index_add_``): ``EagerOrder``.
- ``grouped_mm`` and ``deepgemm``: entries grouped with ``torch.sort(expert_ids)``, then a grouped
  GEMM, the router weight, ``sum(dim=1)``: ``SortGroupedSum``.
- ``batched_mm``: one ``bmm`` per entry, then the router weight and ``sum(dim=1)``: ``BatchedSum``.
- ``sonicmoe`` is not registered: its kernel reduces over k internally, in an order moepage
  cannot reproduce for a step of several waves.

Two quirks of these implementations on CPU, where a GEMM's result for a row may depend on the
row's place among the rows (MKL's M-tail kernels, ~1 ulp in fp32):

- Tie order (``SortGroupedSum``): ``torch.sort`` is not stable (CPU: ``std::sort`` beyond 16
  entries), so the order of one expert's rows inside its group depends on the whole id array. Per
  entry, the rows are therefore handed over in the unpaged within-expert order (``tie_rank``: the
  implementation's own sort of the same ids) and arranged so that its sort by slot id puts every row
  where the unpaged run put it (``order_rows``). On CUDA a grouped GEMM computes each row from that
  row alone (checked ``torch.equal`` on an H200), so there the bookkeeping is skipped and the
  forward runs directly on slot ids.
- Batch of one (``BatchedSum``): CPU fp32 ``bmm`` with a batch of one entry takes another kernel
  than with two or more, so a per-entry wave of a single entry runs it twice and keeps one. The
  direct call has the unpaged batch size, so it is exact everywhere. ``batched_mm`` skips no id
  (outside expert parallelism it indexes its weights with each), so rows to drop go to slot 0.
"""

from __future__ import annotations

import torch

from ..runners import ExpertOrder, ExpertsForward, TopkSum, order_for_sort, register_resolver, register_runner, sort_rank


class EagerOrder(ExpertOrder):
    """HF's ``eager`` loop. It synchronises (``nonzero``), so it is never captured; and up to
    transformers 5.17 it one-hot encodes ids with ``num_experts`` classes, so an id past the slots
    asserts. Per-entry waves therefore run on their own rows only."""

    name = "eager"
    syncs = True


class SortGroupedSum(TopkSum):
    """``grouped_mm``-style: sort-grouped entries, grouped GEMM, ``sum`` over k."""

    name = "grouped_mm"

    def direct(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def tie_rank(self, top_k_index: torch.Tensor) -> torch.Tensor | None:
        if top_k_index.is_cuda:
            return None
        return self.entries(sort_rank(top_k_index).view(top_k_index.shape))

    def order_rows(self, slots: torch.Tensor, rank: torch.Tensor, n: int) -> torch.Tensor:
        return order_for_sort(slots, rank, n)


class BatchedSum(TopkSum):
    """``batched_mm``-style: one ``bmm`` per entry, ``sum`` over k."""

    name = "batched_mm"

    def skip_slot(self, num_slots: int) -> int:
        return 0  # batched_mm indexes its weights with every id: a real slot, computed and dropped

    def forward_rows(
        self, forward: ExpertsForward, x: torch.Tensor, slots: torch.Tensor, weight_dtype: torch.dtype, total: int
    ) -> torch.Tensor:
        if slots.shape[0] != 1 or total == 1:
            return super().forward_rows(forward, x, slots, weight_dtype, total)
        return super().forward_rows(forward, x.repeat(2, 1), slots.repeat(2), weight_dtype, total)[:1]


SORT_GROUPED_SUM = SortGroupedSum()
BATCHED_SUM = BatchedSum()
IMPLEMENTATIONS = {
    "eager": EagerOrder(),
    "grouped_mm": SORT_GROUPED_SUM,
    "deepgemm": SORT_GROUPED_SUM,
    "batched_mm": BATCHED_SUM,
}


def experts_implementation(module: torch.nn.Module) -> str | None:
    """The module's HF experts implementation (``config._experts_implementation``), if any."""
    return getattr(getattr(module, "config", None), "_experts_implementation", None) or None


def register() -> None:
    """Entry point (``moepage.runners``): register HF's implementation names and the resolver."""
    for name, runner in IMPLEMENTATIONS.items():
        register_runner(name, runner)
    register_resolver(experts_implementation)
