"""The ``cuda`` backend and captured decode, on a CUDA GPU (skipped elsewhere, with the reason)."""

from __future__ import annotations

import copy

import pytest
import torch

import moepage
from moepage.backends.protocol import RowSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuda backend, CUDA graphs)"),
]


def _cuda_store():
    pytest.importorskip("cuda.bindings", reason="needs cuda-python (pip install 'moepage[cuda]')")
    from moepage.backends.cuda import CudaStore

    return CudaStore()


def _routing(t: int, e: int, k: int, device, pool: torch.Tensor | None = None) -> torch.Tensor:
    pool = torch.arange(e) if pool is None else pool
    return torch.stack([pool[torch.randperm(len(pool))[:k]] for _ in range(t)]).to(device)


def test_store_is_exact_mapped_and_freed():
    store = _cuda_store()
    specs = {"a": RowSpec((3, 5), torch.bfloat16), "b": RowSpec((7,), torch.float32)}
    store.allocate("L", specs, num_experts=11, num_slots=4, device=torch.device("cuda"))
    assert store.host_bytes() == 11 * (3 * 5 * 2 + 7 * 4)  # exact: no rounding
    host = store.host_rows("L", "a")
    host.copy_(torch.randn(11, 3, 5).to(torch.bfloat16))
    store.page_in("L", [(9, 2), (1, 0)])
    torch.cuda.synchronize()
    assert torch.equal(store.slots("L", "a")[2].cpu(), host[9])
    assert torch.equal(store.slots("L", "a")[0].cpu(), host[1])
    store.close()
    assert store.host_bytes() == 0


def test_pinning_failure_is_clear_and_leaves_nothing():
    store = _cuda_store()
    store.allocate("ok", {"a": RowSpec((1024,), torch.float32)}, 8, 2, torch.device("cuda"))
    held = store.host_bytes()
    huge = RowSpec((1 << 40,), torch.uint8)  # 1 TiB per row: cannot be pinned
    with pytest.raises(MemoryError, match=r"bytes") as info:
        store.allocate("big", {"small": RowSpec((16,), torch.uint8), "huge": huge}, 4, 2, torch.device("cuda"))
    assert str(4 * ((1 << 40) + 16)) in str(info.value) and str(held) in str(info.value)
    assert store.host_bytes() == held
    store.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_device_and_host_planned_steps_are_exact(dtype):
    from moepage.toy import ToyExperts

    torch.manual_seed(0)
    e, k = 32, 4
    ref = ToyExperts(e, 64, 128, k).to("cuda", dtype)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=12, backend=_cuda_store())
    layer = next(moepage.paged_layers(paged))
    assert layer.pager.device_state is not None
    for step in range(60):
        t = [1, 2, 3, 40][step % 4]  # 3 tokens x 4 = 12 = K: device planned; 40: host waves
        x = torch.randn(t, 64, device="cuda", dtype=dtype)
        idx = _routing(t, e, k, "cuda")
        w = torch.rand(t, k, device="cuda", dtype=dtype)
        assert torch.equal(paged(x, idx, w), ref(x, idx, w))
    layer.check_slots()
    s = moepage.stats(paged).total
    assert s.misses > 0 and s.steps == 60


def test_captured_decode_replays_exactly():
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=64, num_experts=32, num_experts_per_tok=4)
    cfg._experts_implementation = "grouped_mm"  # capturable (histc offsets, no host sync)
    ref = Qwen3MoeExperts(cfg).to("cuda", torch.bfloat16)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.05)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=8, backend=_cuda_store())
    layer = next(moepage.paged_layers(paged))
    t, k = 2, 4
    x = torch.randn(t, 128, device="cuda", dtype=torch.bfloat16)
    idx = _routing(t, 32, k, "cuda")
    w = torch.rand(t, k, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: compiles kernels, moves the residency to the device
            paged(x, idx, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged(x, idx, w)
    eager_twin = copy.deepcopy(ref)
    moepage.wrap(eager_twin, resident=8, backend=_cuda_store())
    eager_twin(x, idx, w)
    for _ in range(3):
        eager_twin(x, idx, w)
    for replay in range(200):
        x.copy_(torch.randn_like(x))
        idx.copy_(_routing(t, 32, k, "cuda"))
        w.copy_(torch.rand_like(w))
        graph.replay()
        expected = ref(x, idx, w)
        assert torch.equal(out, expected), f"replay {replay}"
        assert torch.equal(eager_twin(x, idx, w), expected)
    layer.check_slots()
    assert layer.read_stats().misses > 0


def test_capture_on_a_host_planned_layer_raises_clearly():
    """Without the device planner a step cannot be captured: a clear error, not a CUDA one."""
    from moepage.toy import ToyExperts

    paged = ToyExperts(16, 32, 64, 4, "batched_mm").to("cuda", torch.bfloat16)
    moepage.wrap(paged, resident=8, backend=_cuda_store(), device_planner=False)
    x = torch.randn(3, 32, device="cuda", dtype=torch.bfloat16)
    idx = _routing(3, 16, 4, "cuda")
    w = torch.rand(3, 4, device="cuda", dtype=torch.bfloat16)
    paged(x, idx, w)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(moepage.ConfigError, match="being captured, but this layer plans its steps on the host"):
        with torch.cuda.graph(graph):
            paged(x, idx, w)


def test_auto_backend_is_cuda():
    pytest.importorskip("cuda.bindings")
    from moepage.toy import ToyExperts

    paged = ToyExperts(8, 16, 32, 2).to("cuda")
    moepage.wrap(paged, resident=4)
    assert next(moepage.paged_layers(paged)).store.name == "cuda"


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_prefill_overlap_on_a_copy_stream_is_exact(implementation):
    from moepage.toy import ToyExperts

    torch.manual_seed(3)
    e, k = 32, 4
    ref = ToyExperts(e, 64, 128, k, implementation).to("cuda", torch.bfloat16)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=8, backend=_cuda_store(), prefill_overlap=True)
    layer = next(moepage.paged_layers(paged))
    assert layer.pager.config.overlap
    for t in (64, 7, 300, 2, 128):  # multi-wave prefill steps and device-planned decode steps
        x = torch.randn(t, 64, device="cuda", dtype=torch.bfloat16)
        idx = _routing(t, e, k, "cuda")
        w = torch.rand(t, k, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(paged(x, idx, w), ref(x, idx, w))
    layer.check_slots()
    assert moepage.stats(paged).total.waves > 10
