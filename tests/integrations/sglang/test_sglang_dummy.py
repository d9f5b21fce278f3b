"""``--load-format dummy`` through SGLang's own ``DummyModelLoader``: the paged layers' host rows hold what its dummy
fill puts in the unpaged layers' ``[E, ...]`` tensors, bit for bit (not what it puts in the K-row slots), so steps of
one, two and many waves equal unpaged; block FP8 too (its scales' own rule); prefetch is linked after a dummy load; what
dummy weights cannot serve is refused at startup."""

from __future__ import annotations

import random
import types

import pytest
import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)
import torch

from helpers import sglang as H  # noqa: E402
from moepage.errors import ConfigError  # noqa: E402

WAVES = ((2, 3), (4, 6), (7, 8))  # distinct experts a step: one, two and many waves of K = 3


@pytest.fixture(scope="module", autouse=True)
def sglang_process():
    H.setup_sglang()


def dummy_load(make, dtype: torch.dtype, **fields):
    """The model ``make()`` builds, loaded by SGLang's ``DummyModelLoader`` under the published config ``fields`` and
    ``--load-format dummy`` (its model construction and quant config replaced by ``make``'s; the rest its own)."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader import loader

    saved = loader._initialize_model, loader._get_quantization_config
    loader._initialize_model = lambda *args, **kwargs: make()
    loader._get_quantization_config = lambda *args, **kwargs: None
    try:
        with H.server_args(load_format="dummy", **fields):
            H.graph_config()
            return loader.DummyModelLoader(LoadConfig(load_format="dummy")).load_model(
                model_config=types.SimpleNamespace(dtype=dtype), device_config=types.SimpleNamespace(device="cpu"))
    finally:
        loader._initialize_model, loader._get_quantization_config = saved


def dummy_pair(kind: str, dtype: torch.dtype, **fields):
    def make():
        return H.construct(kind, H.hf_config(kind), dtype)

    return dummy_load(make, dtype), dummy_load(make, dtype, **H.paged_args(**fields))


def _host_rows_equal(ref, paged) -> None:
    for r, p in zip(H.moe_layers(ref), H.moe_layers(paged), strict=True):
        method = p.quant_method
        for n in method.names:
            host = method.store.host_rows(method.layer_key, n)
            assert host.shape == getattr(r, n).shape and host.float().abs().max() > 0, n
            assert torch.equal(host.view(torch.uint8), getattr(r, n).data.view(torch.uint8)), n
            assert torch.equal(getattr(p, n).data.view(torch.uint8), host[: method.num_slots].view(torch.uint8)), n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", H.KINDS)
def test_dummy_host_rows_and_steps_equal_unpaged(kind, dtype):
    ref, paged = dummy_pair(kind, dtype)
    _host_rows_equal(ref, paged)
    rng = random.Random(5)
    for r, p in zip(H.moe_layers(ref), H.moe_layers(paged)):
        for i, (lo, hi) in enumerate(WAVES):
            distinct = rng.randint(lo, hi)
            ids = H.routing(rng, rng.randint(max(1, (distinct + 1) // 2), 9), distinct)
            x = torch.randn(ids.shape[0], H.HIDDEN, dtype=dtype, generator=torch.Generator().manual_seed(i)) * 50
            out = H.forward(p, x, H.topk_output(ids, i))
            assert out.abs().max() > 0 and torch.equal(out, H.forward(r, x, H.topk_output(ids, i)))


def test_dummy_block_fp8_rows_and_scales_equal_unpaged():
    """Block FP8: the FP8 weights go through SGLang's float16 detour and the ``weight_scale_inv`` block scales are set
    to 1.0 (its fill's rule by name); the host rows hold both as the unpaged layer, after the base post-load step."""
    def make():
        return H.bare_layer(quant_config=H.fp8_config())

    with H.admitted():
        ref = dummy_load(make, torch.bfloat16)
        paged = dummy_load(make, torch.bfloat16, **H.paged_args())
    method = paged.quant_method
    assert {"w13_weight_scale_inv", "w2_weight_scale_inv"} <= set(method.names)
    assert ref.w13_weight.dtype == torch.float8_e4m3fn
    assert torch.equal(method.store.host_rows(method.layer_key, "w2_weight_scale_inv"),
                       torch.ones_like(ref.w2_weight_scale_inv))
    _host_rows_equal(torch.nn.ModuleList([ref]), torch.nn.ModuleList([paged]))


def test_dummy_compressed_rows_decode_to_unpaged_and_step_equal(monkeypatch):
    """Compress stages the rows: the dummy fill lands in the staging rows, which are coded; they decode to the unpaged
    layer's and steps equal unpaged."""
    monkeypatch.setenv("MOEPAGE_VERIFY", "1")
    ref, paged = dummy_pair("qwen3_moe", torch.bfloat16, _moepage_paged_experts_compress=True)
    rng = random.Random(2)
    for r, p in zip(H.moe_layers(ref), H.moe_layers(paged)):
        method = p.quant_method
        assert method.config.compress and method.store.layer_bytes(method.layer_key).coded
        for n in method.names:
            for e in range(H.E):
                assert torch.equal(method.store.read_row(method.layer_key, n, e), getattr(r, n).data[e]), (n, e)
        ids = H.routing(rng, 6, 8)
        x = torch.randn(6, H.HIDDEN, dtype=torch.bfloat16) * 50
        assert torch.equal(H.forward(p, x, H.topk_output(ids)), H.forward(r, x, H.topk_output(ids)))


def test_dummy_load_links_prefetch(monkeypatch):
    """``DummyModelLoader.load_model`` never runs ``DefaultModelLoader.postprocess_weights`` (where the plugin links
    prefetch): its own hook links the layers, and steps stay exact."""
    monkeypatch.setenv("MOEPAGE_SGLANG_PREFETCH", "on")
    ref, paged = dummy_pair("qwen3_moe", torch.bfloat16)
    (r0, _), (p0, p1) = H.moe_layers(ref), H.moe_layers(paged)
    assert p0.quant_method.prefetch_linked and p0.quant_method.link.target is p1.quant_method.pager
    ids = H.routing(random.Random(1), 4, 5)
    x = torch.randn(4, H.HIDDEN, dtype=torch.bfloat16) * 50
    assert torch.equal(H.forward(p0, x, H.topk_output(ids)), H.forward(r0, x, H.topk_output(ids)))
    assert p1.quant_method.pager.read_stats().prefetched > 0


def test_dummy_with_a_disk_tier_is_refused_at_startup(tmp_path):
    fields = dict(_moepage_paged_experts_host_budget="4", _moepage_paged_experts_spill_dir=str(tmp_path))
    with pytest.raises(ConfigError) as err:
        dummy_pair("qwen3_moe", torch.bfloat16, **fields)
    assert "--load-format dummy with a disk tier (--paged-experts-host-budget)" in str(err.value)
    assert str(err.value).count("\n  - ") == 1 and not list(tmp_path.iterdir())


def test_dummy_integer_experts_are_refused_naming_the_tensors():
    """GPTQ's packed weights are integers, which SGLang's dummy fill leaves uninitialised (unpaged too): refused when
    the layer is built, before any row is allocated."""
    def make():
        return H.bare_layer(quant_config=H.gptq_config(4))

    with pytest.raises(ConfigError, match=r"--load-format dummy: moepage fills floating-point expert tensors .*"
                                          r"'w13_qweight': 'torch.int32'"):
        dummy_load(make, torch.bfloat16, **H.paged_args())
