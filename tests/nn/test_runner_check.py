"""The runner of a paged experts module is the one of its implementation at each call, and it is
checked against the module's own forward before it runs a step: a reduction moepage has not seen
reproduce the module bit for bit is refused, and an implementation's variants (accumulator dtypes)
are chosen by that check."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import moepage
from moepage.toy import ToyExperts, ToyMoE


class SumOverK(nn.Module):
    """A custom experts module (no implementation config) that reduces with ``sum`` over k."""

    def __init__(self, e: int = 8, h: int = 16, i: int = 8, accumulate: torch.dtype | None = None):
        super().__init__()
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) / h**0.5)
        self.down_proj = nn.Parameter(torch.randn(e, h, i) / i**0.5)

    def forward(self, hidden, top_k_index, top_k_weights):
        t, k = top_k_index.shape
        ids = top_k_index.clamp(max=self.num_experts - 1).reshape(-1)
        x = hidden.repeat_interleave(k, dim=0)[:, :, None]
        gate, up = torch.bmm(self.gate_up_proj[ids], x).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down_proj[ids], (F.silu(gate) * up)[:, :, None]).squeeze(-1)
        y = (y * top_k_weights.reshape(-1, 1)).masked_fill((top_k_index.reshape(-1) >= self.num_experts)[:, None], 0)
        return y.view(t, k, -1).sum(dim=1).to(hidden.dtype)


class LoopInFloat32(ToyExperts):
    """An eager loop that accumulates in float32 and casts once at the end (NemotronH does so in
    the router weights' dtype). Its config says "eager", so it is read as HF's eager loop."""

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros(hidden.shape, dtype=torch.float32)
        mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
            if e == self.num_experts:
                continue
            pos, tok = torch.where(mask[e])
            out.index_add_(0, tok, (self._expert(hidden[tok], e) * top_k_weights[tok, pos, None]).float())
        return out.to(hidden.dtype)


def _step(module, tokens=24, top_k=4, seed=1, dtype=torch.bfloat16, weights=torch.float32, e=8):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, module.gate_up_proj.shape[-1], generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=gen).to(weights)
    return x, ids, w


def test_a_reduction_that_does_not_match_the_module_is_refused_at_its_first_step():
    torch.manual_seed(0)
    module = SumOverK().to(torch.bfloat16)
    moepage.wrap(module, resident=4, name="custom")  # no resolver knows it: expert_order, checked
    with pytest.raises(moepage.ConfigError,
                       match=r"layer custom \(SumOverK\): moepage cannot reproduce its forward") as info:
        module(*_step(module))
    assert "expert_order (expert_order, accumulating in the hidden dtype)" in str(info.value)
    assert "register a moepage.Runner" in str(info.value)


def test_the_matching_runner_is_exact_and_checked_once():
    torch.manual_seed(0)
    module = SumOverK().to(torch.bfloat16)
    ref = copy.deepcopy(module)
    moepage.wrap(module, resident=4, implementation="topk_sum")
    layer = next(moepage.paged_layers(module))
    calls = []
    forward = layer.original_forward
    layer.original_forward = lambda *a: (calls.append(1), forward(*a))[1]
    for seed in range(3):
        step = _step(module, seed=seed)
        assert torch.equal(module(*step), ref(*step))
    checks = len(calls) - moepage.stats(module).total.waves  # a step's call per wave (topk_sum is direct)
    assert checks == 3  # the check: its reference call and one per wave of its two, once
    assert moepage.stats(module).total.waves > moepage.stats(module).total.steps  # several waves


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_an_accumulator_variant_is_chosen_by_the_check(weights):
    torch.manual_seed(0)
    module = LoopInFloat32(8, 16, 8, 4).to(torch.bfloat16)
    ref = copy.deepcopy(module)
    moepage.wrap(module, resident=4)
    for seed in range(3):
        step = _step(module, seed=seed, weights=weights)
        assert torch.equal(module(*step), ref(*step))
    chosen = set(next(moepage.paged_layers(module))._checked.values())
    assert {r.accumulate for r in chosen} == {"float32" if weights == torch.bfloat16 else "weights"}


@pytest.mark.parametrize("order", [("eager", "grouped_mm", "batched_mm", "eager"), ("batched_mm", "grouped_mm")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_switching_implementation_after_wrap_is_followed(order, dtype):
    torch.manual_seed(0)
    model = ToyMoE(vocab=64, hidden=32, inter=32, layers=2, num_experts=8, top_k=3, implementation=order[0]).to(dtype)
    ref = copy.deepcopy(model)
    moepage.wrap(model, resident=4)
    gen = torch.Generator().manual_seed(2)
    for impl in order:
        for m in (model, ref):
            for block in m.blocks:
                block.experts.config._experts_implementation = impl
        layer = next(moepage.paged_layers(model))
        assert layer.runner.name == impl
        for tokens in (1, 20):
            ids = torch.randint(0, 64, (tokens,), generator=gen)
            assert torch.equal(model(ids), ref(ids)), impl


def test_k_equal_e_is_the_modules_own_forward_whatever_it_reduces():
    """At K = E every expert sits in its own slot: steps are the module's own forward, so even a
    reduction no runner describes is exact."""
    torch.manual_seed(0)
    module = SumOverK().to(torch.bfloat16)
    ref = copy.deepcopy(module)
    moepage.wrap(module, resident=8)
    step = _step(module)
    assert torch.equal(module(*step), ref(*step))
