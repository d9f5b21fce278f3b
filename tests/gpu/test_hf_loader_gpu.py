"""Hugging Face models in bf16 on CUDA: wrap and from_pretrained equal to unpaged."""

from __future__ import annotations

import pytest
import safetensors  # noqa: F401  (the [test] extra installs it)
import torch

import moepage  # noqa: E402
from helpers.hf import ARCHS, FORMATS, IMPLS, assert_paged, assert_same, make_checkpoints, reference, run
from moepage.integrations import transformers as mhf  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoints(tmp_path_factory)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("arch", ARCHS)
def test_wrap_exact_cuda_bf16(checkpoint, arch, impl):
    path, k = checkpoint(arch)
    model = reference(path, torch.bfloat16, impl, device="cuda")
    ref = run(model, "cuda")
    moepage.wrap(model, resident=k)
    assert_same(ref, run(model, "cuda"))
    assert_paged(model, k)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_from_pretrained_exact_cuda_bf16(checkpoint, arch, fmt):
    path, k = checkpoint(arch, fmt)
    ref = run(reference(path, torch.bfloat16, "grouped_mm", device="cuda"), "cuda")
    model = mhf.from_pretrained(path, resident=k, device="cuda", dtype=torch.bfloat16,
                                experts_implementation="grouped_mm", progress=False)
    assert_same(ref, run(model, "cuda"))
    assert_paged(model, k)
