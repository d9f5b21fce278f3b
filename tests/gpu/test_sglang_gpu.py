"""SGLang's CUDA kernels paged exactly: the Triton fused MoE (bf16, block FP8), Marlin (GPTQ, repacked K experts at a time), and captured decode between eager steps."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("sglang.srt.layers.moe.paged_experts", reason="needs sglang==0.5.23 (ci/sglang-requirements.txt)")

from moepage.integrations.sglang import compat  # noqa: E402

from helpers import sglang as H  # noqa: E402
from helpers.sglang import (  # noqa: E402
    bf16_checkpoint, compare_on_gpu, gpu_pair, has_sgl_kernel,
    FMT_H, forward, fp8_block_checkpoint, fp8_config, gptq_checkpoint,
    gptq_config,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture(scope="module", autouse=True)
def sglang_process():
    H.setup_sglang()


# -- GPU: SGLang's CUDA kernels (Triton fused MoE, block FP8, Marlin) -------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (SGLang's fused-MoE kernels are CUDA-only)")
needshas_sgl_kernel = pytest.mark.skipif(not has_sgl_kernel(), reason="needs sgl_kernel (sglang-kernel), which SGLang's CUDA MoE path imports")


@pytest.mark.gpu
@needshas_sgl_kernel
@needs_cuda
def test_gpu_triton_unquantized_paged_equals_unpaged():
    ref, paged = gpu_pair(None, bf16_checkpoint())
    assert paged.quant_method.contract is compat.TRITON
    compare_on_gpu(ref, paged)


@pytest.mark.gpu
@needshas_sgl_kernel
@needs_cuda
def test_gpu_triton_block_fp8_paged_equals_unpaged():
    ref, paged = gpu_pair(fp8_config, fp8_block_checkpoint())
    compare_on_gpu(ref, paged)


@pytest.mark.gpu
@needshas_sgl_kernel
@needs_cuda
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_gptq_marlin_repacked_k_at_a_time(bits):
    ref, paged = gpu_pair(lambda: gptq_config(bits), gptq_checkpoint(bits, seed=bits))
    method = paged.quant_method
    assert method.contract is compat.MARLIN and "w13_qzeros" not in method.pager.specs
    compare_on_gpu(ref, paged)


@pytest.mark.gpu
@needshas_sgl_kernel
@needs_cuda
def test_gpu_triton_captured_decode_between_eager_steps():
    """The serving flow on SGLang's Triton runner: a decode step of 2 tokens x top-2 = 4 entries
    > K = 3 (two device waves) captured in a CUDA graph the way SGLang's runner captures it
    (warm-up and capture in capture mode), replayed on fresh routing between eager host-planned
    steps. Every output equals the unpaged layer's."""
    import moepage.capture as pager_module

    ref, paged = gpu_pair(None, bf16_checkpoint(3), graphs=("full", "disabled"))
    assert paged.quant_method.pager.device_state is not None
    rng = random.Random(3)

    def topk_of(ids, seed):
        topk = H.topk_output(ids.cpu(), seed)
        return topk._replace(topk_weights=topk.topk_weights.cuda(), topk_ids=ids)

    ids = H.routing(rng, 2, 4).cuda()
    x = torch.randn(2, FMT_H, dtype=torch.bfloat16, device="cuda")
    topk = topk_of(ids, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), pager_module.capture_mode():
        assert torch.equal(forward(paged, x, topk), forward(ref, x, topk))  # warm-up: a real step
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with pager_module.capture_mode(), torch.cuda.graph(graph):
        out = forward(paged, x, topk)
    replays = 0
    for i in range(20):
        tokens, distinct = rng.choice([(9, 8), (5, 6), (16, 8)])
        e_ids = H.routing(rng, tokens, distinct).cuda()
        e_x = torch.randn(tokens, FMT_H, dtype=torch.bfloat16, device="cuda")
        assert torch.equal(forward(paged, e_x, topk_of(e_ids, i)), forward(ref, e_x, topk_of(e_ids, i))), f"eager {i}"
        for _ in range(3):
            ids.copy_(H.routing(rng, 2, rng.randint(2, 4)).cuda())
            x.copy_(torch.randn_like(x))
            graph.replay()
            assert torch.equal(out, forward(ref, x, topk)), f"replay after eager {i}"
            replays += 1
    assert replays == 60
