"""The runner contract: how a layer's own expert computation runs per routed entry, and how the
per-entry outputs are reduced exactly as the unpaged layer reduces them.

An experts module follows the Hugging Face v5 convention,
``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` computing
``sum_k w * expert_k(x)``. Fed one entry per row (top_k = 1) with unit weights it returns the
*unweighted* output of each entry with no sum (adding one term to zero is exact). Rows are laid
out in the order the implementation visits tokens within an expert, so every expert's GEMM sees the
same token set in the same order as without paging: the per-entry values are bitwise the same.

The reduction then applies the router weight and sums the entries the way the unpaged
implementation does. Two exist in the wild:

- ``expert_order`` (HF "eager", the for-loop with ``index_add_``): rows in (k, token) order; for
  each token, weighted entries cast to the hidden dtype are added to zero in ascending expert id.
- ``topk_sum`` (HF "grouped_mm" / "batched_mm"): rows in (token, k) order; weighted entries are
  summed over k with ``sum(dim=1)`` and cast to the hidden dtype.

Batch of one (``pads_single``): CPU fp32 ``bmm`` with a batch of one entry takes another kernel
than with two or more (HF "batched_mm"); a wave with a single entry runs it twice.

Tie order (``sorts_ids``): HF "grouped_mm" groups entries with ``torch.sort(expert_ids)``, which is
not stable (CPU: ``std::sort`` beyond 16 entries), so the order of one expert's rows inside its
group depends on the whole id array; and a CPU GEMM's result for a row depends on the row's
position among the M rows (MKL's M-tail kernels), ~1 ulp in fp32. Such a runner therefore hands
the layer its rows in the unpaged within-expert order (``tie_rank``: the implementation's own sort
of the same ids) and arranged so that the implementation's sort by slot id, a deterministic
function of the id array it sees, puts every row where the unpaged run put it (``_arrange``).
On CUDA this bookkeeping is skipped: a grouped GEMM there computes each row from that row alone,
so a row's bits do not depend on its place in its group (checked ``torch.equal`` on an H200 by the
GPU tests and benchmarks), and the bookkeeping would cost ~60 us of small kernels per decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

ExpertsForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Runner:
    """Entry order + reduction for one experts implementation."""

    name: str
    k_major: bool  # rows ordered (k, token) rather than (token, k)
    sorts_ids: bool = False  # the implementation groups entries by torch.sort(ids) (not stable)
    pads_single: bool = False  # the implementation's kernel differs for a batch of one entry (bmm)

    def entry_tokens(self, num_tokens: int, top_k: int, device: torch.device) -> torch.Tensor:
        """Token index of every row, in this runner's entry order."""
        t = torch.arange(num_tokens, device=device)
        return t.repeat(top_k) if self.k_major else t.repeat_interleave(top_k)

    def entries(self, x: torch.Tensor) -> torch.Tensor:
        """A ``[T, k]`` routing tensor flattened into this runner's entry order."""
        return (x.t() if self.k_major else x).reshape(-1)

    def run(
        self,
        forward: ExpertsForward,
        hidden: torch.Tensor,
        rows: torch.Tensor | None,
        row_tokens: torch.Tensor,
        row_slots: torch.Tensor,
        weight_dtype: torch.dtype,
        rank: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Unweighted output of the entries ``rows`` (all when None) on their slots, in the
        order of ``rows``. ``rank``: ``tie_rank`` of the step (runners that sort ids)."""
        tokens = row_tokens if rows is None else row_tokens[rows]
        slots = row_slots if rows is None else row_slots[rows]
        order = None
        if rank is not None:
            order = self._arrange(slots, rank if rows is None else rank[rows], rank.numel())
            tokens, slots = tokens[order], slots[order]
        single = self.pads_single and slots.shape[0] == 1 and row_tokens.shape[0] > 1
        if single:  # CPU fp32 bmm of batch 1 takes another kernel: run the entry twice, keep one
            tokens, slots = tokens.repeat(2), slots.repeat(2)
        ones = torch.ones(slots.shape[0], 1, dtype=weight_dtype, device=hidden.device)
        out = forward(hidden[tokens], slots[:, None], ones)
        if single:
            out = out[:1]
        if order is None:
            return out
        back = torch.empty_like(out)
        back[order] = out
        return back

    def tie_rank(self, top_k_index: torch.Tensor) -> torch.Tensor | None:
        """Position of every entry (in this runner's entry order) in the unpaged layer's sort of
        the expert ids: its own call on the same tensor, hence the same tie order. None unless
        the implementation sorts, and on CUDA, where a row's place in its group does not change
        its result."""
        if not self.sorts_ids or top_k_index.is_cuda:
            return None
        perm = torch.sort(top_k_index.reshape(-1))[1]
        rank = torch.empty_like(perm)
        rank[perm] = torch.arange(perm.numel(), device=perm.device)
        return self.entries(rank.view(top_k_index.shape))

    @staticmethod
    def _arrange(slots: torch.Tensor, rank: torch.Tensor, n: int) -> torch.Tensor:
        """An order of the entries such that sorting their slot ids with ``torch.sort`` groups
        them by slot with each group in ascending ``rank``. Sync-free (capturable)."""
        want = torch.argsort(slots * n + rank)  # distinct keys: the target grouped order
        # Permuting entries within equal slot ids leaves the id array, hence the sort's
        # permutation ``p``, unchanged: place the entries where ``p`` will fetch them from.
        p = torch.sort(slots[want])[1]
        order = torch.empty_like(want)
        order[p] = want
        return order

    def reduce(
        self,
        merged: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        valid: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """The unpaged layer's final reduction over ``merged`` (rows in entry order)."""
        t, k = top_k_index.shape
        h = merged.shape[-1]
        if self.name == "topk_sum":
            weighted = merged.view(t, k, h) * top_k_weights[..., None]
            weighted = weighted.masked_fill(~valid[..., None], 0)
            return weighted.sum(dim=1).to(out_dtype)
        # expert_order: add each token's entries to zero in ascending expert id.
        contrib = (merged.view(k, t, h) * top_k_weights.t()[..., None]).to(out_dtype)
        contrib = contrib.masked_fill(~valid.t()[..., None], 0)
        order = torch.argsort(top_k_index.masked_fill(~valid, torch.iinfo(top_k_index.dtype).max).t(), dim=0)
        contrib = contrib.gather(0, order[..., None].expand(k, t, h))
        out = torch.zeros(t, h, dtype=out_dtype, device=merged.device)
        for j in range(k):
            out = out + contrib[j]
        return out


EXPERT_ORDER = Runner("expert_order", k_major=True)
TOPK_SUM = Runner("topk_sum", k_major=False)
GROUPED_SUM = Runner("topk_sum", k_major=False, sorts_ids=True)  # sort-grouped, then topk_sum
BATCHED_SUM = Runner("topk_sum", k_major=False, pads_single=True)  # per-entry bmm, then topk_sum

# Experts implementations (HF's ExpertsInterface names) -> runner. Register more here.
RUNNERS: dict[str, Runner] = {
    "eager": EXPERT_ORDER,
    "expert_order": EXPERT_ORDER,
    "grouped_mm": GROUPED_SUM,
    "batched_mm": BATCHED_SUM,
    "topk_sum": TOPK_SUM,
}


def runner_for(module: torch.nn.Module, declared: str | None) -> Runner:
    """The runner of ``module``: the declared one, else its HF experts implementation, else eager."""
    name = declared
    if name is None:
        config = getattr(module, "config", None)
        name = getattr(config, "_experts_implementation", None) or "eager"
    try:
        return RUNNERS[name]
    except KeyError:
        raise KeyError(
            f"no moepage runner for experts implementation {name!r}; known: {sorted(RUNNERS)}"
        ) from None
