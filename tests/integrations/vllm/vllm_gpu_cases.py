"""moepage's vLLM plugin on a CUDA GPU with vLLM's own Triton expert kernel (``vllm_cases`` runs a torch stand-in on
the CPU): one MoE layer built by vLLM's factory and loaded by its loader, unpaged and paged, stepped eagerly (planned
on the host and on the device) and replayed from CUDA graphs, compared bit for bit. Shapes of the engine check's
checkpoints (Mixtral's, Qwen3-30B-A3B's; the latter in block FP8 too), tokens from one to a prefill, so one, two
and many waves. Run where vLLM
and a GPU are (the H200's lease: ``bash bench/gpu_vllm_lease.sh layers``); nothing collects it on the CPU, and every
case skips without CUDA."""

from __future__ import annotations

import tempfile

import pytest
import torch

pytest.importorskip("vllm")
if not torch.cuda.is_available():
    pytest.skip("vLLM's Triton expert kernel needs a CUDA GPU", allow_module_level=True)

import vllm_layers  # noqa: E402
from vllm.config import KernelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.v1.worker.workspace import init_workspace_manager  # noqa: E402

from moepage import capture  # noqa: E402
from moepage.bits import same_bits  # noqa: E402

# name: (E, top_k, hidden, intermediate, K): the engine check's checkpoints (bench/serving/sglang_ckpt.py)
SHAPES = {"mixtral": (8, 2, 1024, 2048, 2), "qwen": (128, 8, 2048, 768, 32)}
TOKENS = (1, 4, 16, 64, 700)


@pytest.fixture(scope="session", autouse=True)
def distributed():
    """vLLM's plugins and process groups (one rank) and its workspace manager, as a GPU worker sets them up."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mkstemp()[1]}")
        initialize_model_parallel(1, 1)
    init_workspace_manager(torch.device("cuda"))
    yield


def _layer(shape: str, chosen: dict | None, dtype: torch.dtype, seed: int = 0, fp8: bool = False):
    """A MoE runner as vLLM builds it (Triton experts; ``fp8``: block FP8, vLLM's Fp8MoEMethod) under moepage's options
    ``chosen``, loaded; (runner, config)."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    e, top_k, hidden, inter, _ = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    parts = (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter)))
    checkpoint = {}
    for x in range(e):
        for name, s in parts:
            w = torch.randn(s, generator=gen) * 0.05
            checkpoint[f"{x}.{name}.weight"] = w.to(torch.float8_e4m3fn if fp8 else dtype)
            if fp8:
                checkpoint[f"{x}.{name}.weight_scale_inv"] = torch.rand((s[0] // 128, s[1] // 128), generator=gen)
    quant = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                      weight_block_size=[128, 128]) if fp8 else None
    runner, config = vllm_layers.build(chosen, checkpoint, device="cuda",
                                       config={"kernel_config": KernelConfig(moe_backend="triton")}, num_experts=e,
                                       top_k=top_k, hidden_size=hidden, intermediate_size=inter, params_dtype=dtype,
                                       quant_config=quant)
    base = "Fp8MoEMethod" if fp8 else "UnquantizedFusedMoEMethod"
    assert type(runner.routed_experts.quant_method).__name__ == ("PagedVllmMethod" if chosen else base)
    return runner, config


_step = vllm_layers.step


def _inputs(shape: str, tokens: int, dtype: torch.dtype, seed: int):
    e, _, hidden, _, _ = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    return x, torch.randn(tokens, e, generator=gen, device="cuda").to(dtype)


@pytest.mark.parametrize("planner", ["host", "device"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_eager_paged_steps_equal_unpaged_with_vllms_kernel(shape, dtype, planner, monkeypatch):
    monkeypatch.setenv("MOEPAGE_DEVICE_PLANNER", "1" if planner == "device" else "0")
    k = SHAPES[shape][4]
    plain, plain_config = _layer(shape, None, dtype)
    paged, paged_config = _layer(shape, {"num_resident": k}, dtype)
    pager = paged.routed_experts.quant_method.pager
    waves = set()
    for tokens in TOKENS + (1,):  # a prefill between decode steps, then decode again
        x, logits = _inputs(shape, tokens, dtype, seed=tokens)
        before = pager.read_stats().waves
        got = _step(paged, paged_config, x, logits)
        waves.add(pager.read_stats().waves - before)
        assert same_bits(got, _step(plain, plain_config, x, logits)), (shape, tokens)
    assert max(waves) > 1 and min(waves) == 1, waves


@pytest.mark.parametrize("planner", ["host", "device"])
def test_eager_block_fp8_steps_equal_unpaged_with_vllms_kernel(planner, monkeypatch):
    """vLLM's block-FP8 experts (Qwen3-30B-A3B shapes): each expert's FP8 rows and block scales paged together."""
    monkeypatch.setenv("MOEPAGE_DEVICE_PLANNER", "1" if planner == "device" else "0")
    plain, plain_config = _layer("qwen", None, torch.bfloat16, fp8=True)
    paged, paged_config = _layer("qwen", {"num_resident": SHAPES["qwen"][4]}, torch.bfloat16, fp8=True)
    for tokens in TOKENS + (1,):
        x, logits = _inputs("qwen", tokens, torch.bfloat16, seed=tokens)
        assert same_bits(_step(paged, paged_config, x, logits), _step(plain, plain_config, x, logits)), tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_captured_paged_steps_equal_unpaged_with_vllms_kernel(shape, tokens, dtype, monkeypatch):
    """A step captured as vLLM's full decode graph takes it (device-planned, fixed waves), replayed on new routing
    between eager steps, each replay equal to the unpaged layer's eager step."""
    monkeypatch.setenv("MOEPAGE_DEVICE_PLANNER", "1")
    k = SHAPES[shape][4]
    plain, plain_config = _layer(shape, None, dtype)
    paged, paged_config = _layer(shape, {"num_resident": k}, dtype)
    x, logits = _inputs(shape, tokens, dtype, seed=0)
    with capture.capture_mode():  # warm up as captured: the planner's kernels compile, the workspace grows
        _step(paged, paged_config, x, logits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(paged, paged_config, x, logits)
    for seed in range(1, 6):
        new_x, new_logits = _inputs(shape, tokens, dtype, seed=seed)
        x.copy_(new_x)
        logits.copy_(new_logits)
        graph.replay()
        assert same_bits(out, _step(plain, plain_config, x, logits)), (shape, tokens, seed)
        if seed % 2:  # an eager prefill between replays (host-planned where it needs more than K)
            px, plogits = _inputs(shape, 300, dtype, seed=100 + seed)
            assert same_bits(_step(paged, paged_config, px, plogits), _step(plain, plain_config, px, plogits))
