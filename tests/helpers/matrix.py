"""What the architecture matrix runs and compares: prompts, outputs (prompt logits and greedy
generation), the unpaged reference of a case."""

from __future__ import annotations

import pytest
import torch

from . import support


def prompt(arch, batch: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, arch.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def forward(model, arch, ids, mask=None) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if arch.causal_lm else out.last_hidden_state


def outputs(model, arch, flow: str) -> list[torch.Tensor]:
    """What the flow compares: prompt outputs, and for causal LMs the greedy generation."""
    ids = prompt(arch)
    mask = None
    if flow == "padded":
        ids[1, :5] = 0
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
    with torch.no_grad():
        outs = [forward(model, arch, ids, mask)]
    if arch.causal_lm and flow in ("generate", "capture_mode", "inference_mode"):
        gen = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
        outs += [gen.sequences, *gen.logits]
    return outs


def assert_equal(want: list[torch.Tensor], got: list[torch.Tensor], what: str) -> None:
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got)):
        assert a.shape == b.shape and torch.equal(a, b), (
            f"{what}: output {i} differs, max |d| = {(a.double() - b.double()).abs().max().item():.3g}")


def unpaged(arch, case: support.Case, seed: int = 0):
    """The reference model, in the case's dtype and implementation; skips with transformers'
    own error where the unpaged model cannot run the case."""
    model = arch.build(seed).to(case.dtype)
    model.requires_grad_(False)
    why = support.unpaged_refusal(arch, case.impl, case.dtype)
    if why:
        pytest.skip(f"the unpaged model cannot run it: {why}")
    model.set_experts_implementation(case.impl) if arch.dispatches else None
    return model


def outputs_on(model, arch, device) -> list[torch.Tensor]:
    ids = prompt(arch).to(device)
    with torch.no_grad():
        outs = [forward(model, arch, ids)]
    if arch.causal_lm:
        gen = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
        outs += [gen.sequences, *gen.logits]
    return outs
