"""A small MoE language model in the Hugging Face v5 experts convention, for the quickstart, tests and benchmarks.
``ToyExperts`` computes like HF's "eager" loop (ascending id, ``index_add_``), "grouped_mm" (experts sorted, ``sum``
over top-k) or "batched_mm" (one matmul per entry, ``sum`` over top-k); ids >= ``num_experts`` are padding."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F


class ToyExperts(nn.Module):
    """E SwiGLU experts stacked as ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, declaring that layout as
    transformers' experts modules do (which moepage's CPU experts read: ``cpu_share``)."""

    has_gate, has_bias, is_transposed, is_concatenated = True, False, False, True

    def __init__(self, num_experts: int, hidden: int, inter: int, top_k: int, implementation: str = "eager"):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, inter) / inter**0.5)
        self.config = SimpleNamespace(_experts_implementation=implementation, num_experts_per_tok=top_k)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        return F.linear(self._apply_gate(F.linear(x, self.gate_up_proj[e])), self.down_proj[e])

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.config._experts_implementation == "grouped_mm":
            return self._grouped(hidden, top_k_index, top_k_weights)
        if self.config._experts_implementation == "batched_mm":
            return self._batched(hidden, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden)
        # Index num_experts is padding, as in HF's eager loop.
        mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
            if e == self.num_experts:
                continue
            pos, tok = torch.where(mask[e])
            y = self._expert(hidden[tok], e) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def _grouped(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        t, k = top_k_index.shape
        ids, perm = torch.sort(top_k_index.reshape(-1))  # not stable, as HF's grouped_mm
        x = hidden[perm // k]
        y = torch.zeros(t * k, hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
        # Ids >= num_experts (padding) sort last and are skipped, as HF's histc drops them.
        counts = torch.bincount(ids, minlength=self.num_experts)[: self.num_experts].tolist()
        start = 0
        for e, n in enumerate(counts):
            if n:
                y[start : start + n] = self._expert(x[start : start + n], e)
            start += n
        y = y * top_k_weights.reshape(-1)[perm, None]
        unsorted = torch.empty_like(y)
        unsorted[perm] = y
        return unsorted.view(t, k, -1).sum(dim=1).to(hidden.dtype)

    def _batched(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        t, k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        pad = ids >= self.num_experts
        ids = ids.clamp(max=self.num_experts - 1)
        x = hidden.repeat_interleave(k, dim=0)[:, :, None]
        gate, up = torch.bmm(self.gate_up_proj[ids], x).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down_proj[ids], (F.silu(gate) * up)[:, :, None]).squeeze(-1)
        y = (y * top_k_weights.reshape(-1, 1)).masked_fill(pad[:, None], 0)
        return y.view(t, k, -1).sum(dim=1).to(hidden.dtype)


class ToyRouter(nn.Module):
    def __init__(self, num_experts: int, hidden: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.randn(num_experts, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight).softmax(dim=-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        return index, (weights / weights.sum(-1, keepdim=True)).to(x.dtype)


class ToyMoEBlock(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int, top_k: int, implementation: str):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.router = ToyRouter(num_experts, hidden, top_k)
        self.experts = ToyExperts(num_experts, hidden, inter, top_k, implementation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        index, weights = self.router(h)
        return x + self.experts(h, index, weights)


class ToyMoE(nn.Module):
    """Embedding -> ``layers`` MoE blocks -> LM head; ``forward(ids [T]) -> logits [T, vocab]``."""

    def __init__(
        self,
        vocab: int = 256,
        hidden: int = 64,
        inter: int = 128,
        layers: int = 4,
        num_experts: int = 16,
        top_k: int = 4,
        implementation: str = "eager",
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            ToyMoEBlock(num_experts, hidden, inter, top_k, implementation) for _ in range(layers)
        )
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy decoding, recomputing the prefix each step (no KV cache: it is a toy)."""
        for _ in range(new_tokens):
            ids = torch.cat([ids, self(ids)[-1:].argmax(-1)])
        return ids
