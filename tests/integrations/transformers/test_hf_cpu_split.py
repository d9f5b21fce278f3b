"""A CPU share (``cpu_share``) on transformers' MoE architectures: each one's experts on the CPU, from the layout its
class declares (SwiGLU, gpt-oss's clamped and biased variant, DeepSeek's and GLM's routed experts), pass the check
against the module's own forward at wrap and give outputs within the split's tolerance of unpaged; ``from_pretrained``
takes it and refuses a bad value before reading the checkpoint."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import moepage
from helpers import hf as H
from helpers import tiny
from moepage.integrations import transformers as mhf

pytestmark = pytest.mark.usefixtures("single_thread")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative to the largest logit (docs/cpu-split.md)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", H.ARCHS)
def test_every_architecture_splits_within_the_tolerance(arch, dtype):
    config, k = H.configs()[arch]
    torch.manual_seed(0)
    ref = H.own(AutoModelForCausalLM.from_config(config)).to(dtype).eval()
    model = moepage.wrap(copy.deepcopy(ref), resident=k, backend="torch", cpu_share=0.5)
    assert all(layer.pager.split.expert is not None for layer in moepage.paged_layers(model))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    want, got = ref(ids).logits.float(), model(ids).logits.float()
    assert (got - want).abs().max().item() <= TOLERANCE[dtype] * want.abs().max().item()
    assert moepage.stats(model).total.cpu > 0


def test_from_pretrained_takes_a_cpu_share():
    model = mhf.from_pretrained(str(tiny.CKPT), 4, device="cpu", cpu_share="auto", progress=False)
    assert all(layer.pager.split.costs is not None for layer in moepage.paged_layers(model))  # measured at load
    out = model.generate(tiny.text_tokens(16), max_new_tokens=4, do_sample=False, pad_token_id=tiny.PAD)
    assert out.shape == (1, 20)


def test_from_pretrained_refuses_a_bad_cpu_share_before_reading_the_checkpoint(tmp_path):
    with pytest.raises(moepage.ConfigError, match=r"cpu_share=3 is not off, auto or a share in \(0, 1\]"):
        mhf.from_pretrained(str(tmp_path / "nowhere"), 4, device="cpu", cpu_share=3, progress=False)
