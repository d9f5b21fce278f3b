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
    ) -> torch.Tensor:
        """Unweighted output of the entries ``rows`` (all when None) on their slots."""
        tokens = row_tokens if rows is None else row_tokens[rows]
        slots = row_slots if rows is None else row_slots[rows]
        ones = torch.ones(slots.shape[0], 1, dtype=weight_dtype, device=hidden.device)
        return forward(hidden[tokens], slots[:, None], ones)

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

# Experts implementations (HF's ExpertsInterface names) -> runner. Register more here.
RUNNERS: dict[str, Runner] = {
    "eager": EXPERT_ORDER,
    "expert_order": EXPERT_ORDER,
    "grouped_mm": TOPK_SUM,
    "batched_mm": TOPK_SUM,
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
