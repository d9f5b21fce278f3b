"""Modules for tests: a random ``ToyExperts`` with its unpaged copy, the paged layer of a module."""

from __future__ import annotations

import copy

import torch

import moepage
from moepage import step
from moepage.toy import ToyExperts

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

def make_experts(
    num_experts: int = 8,
    hidden: int = 16,
    inter: int = 8,
    top_k: int = 2,
    implementation: str = "eager",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[ToyExperts, ToyExperts]:
    """A fresh random ``ToyExperts`` and a deep copy of it (the unpaged reference)."""
    torch.manual_seed(seed)
    module = ToyExperts(num_experts, hidden, inter, top_k, implementation).to(dtype)
    return module, copy.deepcopy(module)


def layer_of(module: torch.nn.Module) -> moepage.PagedLayer:
    layer = getattr(module, "_moepage", None)
    assert layer is not None, "module is not wrapped"
    return layer


@torch.no_grad()
def device_forward(layer: moepage.PagedLayer, hidden, top_k_index, top_k_weights, runner=None) -> torch.Tensor:
    """The captured step (``step.device_step``) of a paged experts module, called directly."""
    runner = runner or layer.runner
    return step.device_step(layer.pager, top_k_index, layer.waves(runner, hidden, top_k_index, top_k_weights),
                            layer.after_page_in(hidden))


@torch.no_grad()
def host_forward(layer: moepage.PagedLayer, hidden, top_k_index, top_k_weights, runner=None) -> torch.Tensor:
    """A host-planned step (``step.host_step``) of a paged experts module, called directly."""
    runner = runner or layer.runner
    return step.host_step(layer.pager, top_k_index, layer.waves(runner, hidden, top_k_index, top_k_weights),
                          layer.after_page_in(hidden))
