"""No runner feeds an experts module an id it is not declared to skip: a per-entry wave puts the
other waves' entries on the sentinel slot K (= the module's ``num_experts`` once paged) only
under a runner with ``skips_sentinel``; any other runs on its own rows.

Pins the failure of ``test_cuda_bf16_paged_equals_unpaged[0-step3p5-eager]`` with transformers
5.17 on an H200: 5.17's ``Step3p7Experts`` (no experts implementation, hence the generic
``expert_order`` runner) one-hot encodes ids with ``num_experts`` classes, so the sentinel id K
of moepage's runner check made CUDA's scatter assert (``index out of bounds``), which poisons the
process's CUDA context; on the CPU ``one_hot`` raised and wrap's check refused the module. The
modules here are written in its style (and in the style of a gather with no clamp), so the case
runs with any transformers: paged steps must equal unpaged (``torch.equal``) and no call may see
an id outside [0, K)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import moepage
from moepage.toy import ToyExperts

E, H, I, TOP_K, K = 8, 16, 8, 2, 4


class OneHotLoop(nn.Module):
    """transformers 5.17's ``Step3p7Experts.forward``: ``one_hot(num_classes=num_experts)``, so an
    id >= num_experts is out of bounds (its ``== num_experts`` skip can never fire)."""

    def __init__(self):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) / H**0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) / I**0.5)

    def forward(self, hidden, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden)
        mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            gate, up = F.linear(hidden[token_idx], self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current = F.linear(F.silu(gate) * up, self.down_proj[expert_idx])
            current = current * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, current.to(final.dtype))
        return final


class GatherSum(OneHotLoop):
    """A ``sum`` over k of experts gathered by id, with no clamp: an id >= num_experts indexes
    out of bounds (declared ``topk_sum``)."""

    def forward(self, hidden, top_k_index, top_k_weights):
        t, k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        x = hidden.repeat_interleave(k, dim=0)[:, :, None]
        gate, up = torch.bmm(self.gate_up_proj[ids], x).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down_proj[ids], (F.silu(gate) * up)[:, :, None]).squeeze(-1)
        return (y * top_k_weights.reshape(-1, 1)).view(t, k, -1).sum(dim=1).to(hidden.dtype)


def _spy(module) -> list[torch.Tensor]:
    """Every id tensor the paged module's own forward is called with (the check's and the steps')."""
    layer = next(moepage.paged_layers(module))
    seen, forward = [], layer.original_forward
    layer.original_forward = lambda x, ids, w: (seen.append(ids.clone()), forward(x, ids, w))[1]
    return seen


def _step(seed: int, tokens: int = 12):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, TOP_K, generator=gen)  # bf16 hidden, fp32 router weights


@pytest.mark.parametrize("cls, implementation", [(OneHotLoop, None), (GatherSum, "topk_sum")])
def test_a_module_not_declared_to_skip_the_sentinel_never_sees_it(cls, implementation):
    torch.manual_seed(0)
    module = cls().to(torch.bfloat16)
    ref = copy.deepcopy(module)
    moepage.wrap(module, resident=K, implementation=implementation)
    seen = _spy(module)
    for seed in range(3):
        step = _step(seed)
        assert torch.equal(module(*step), ref(*step))
    assert moepage.stats(module).total.waves > moepage.stats(module).total.steps  # several waves
    ids = torch.cat([s.reshape(-1) for s in seen])
    assert int(ids.min()) >= 0 and int(ids.max()) < K, "a module was fed an id outside its slot table"


def test_a_runner_declared_to_skip_the_sentinel_keeps_every_row():
    """``batched_mm`` declares ``skips_sentinel``: its waves run every row (no host sync, so a
    CUDA graph can capture them), the other waves' entries on slot K."""
    torch.manual_seed(0)
    module = ToyExperts(E, H, I, TOP_K, "batched_mm").to(torch.bfloat16)
    ref = copy.deepcopy(module)
    moepage.wrap(module, resident=K)
    seen = _spy(module)
    step = _step(0)
    assert torch.equal(module(*step), ref(*step))
    full = [s for s in seen if s.numel() == step[1].numel()]  # every entry's row, in a per-entry call
    assert any(int(s.max()) == K for s in full)
