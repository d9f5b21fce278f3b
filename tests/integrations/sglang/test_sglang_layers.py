"""Real FusedMoE layers of real SGLang model classes (Qwen3-MoE, Mixtral), built and loaded from
tiny random checkpoints through SGLang's own loaders and paged through moepage, compared bit for
bit with the unpaged layers: host rows, one, two and many waves, dtypes, the device planner and
host steps sharing one state, the eager break, every tensor naming its device."""

from __future__ import annotations

import random

import pytest
import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)
import torch

import moepage  # noqa: E402
from helpers import sglang as H  # noqa: E402
from helpers.sglang import (  # noqa: E402
    K,
    build_pair,
    forward,
    gptq_checkpoint,
    gptq_config,
    quant_pair,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture(scope="module", autouse=True)
def sglang_process():
    H.setup_sglang()


# -- loading --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", H.KINDS)
def test_host_rows_equal_unpaged_rows(kind, dtype):
    from moepage.integrations.sglang.method import PagedMoeMethod

    ref, paged = build_pair(kind, DTYPES[dtype])
    pairs = list(zip(H.moe_layers(ref), H.moe_layers(paged)))
    assert len(pairs) == 2
    for r, p in pairs:
        method = p.quant_method
        assert isinstance(method, PagedMoeMethod)
        assert set(method.names) == {"w13_weight", "w2_weight"}
        for n in method.names:
            host = method.store.host_rows(method.layer_key, n)
            assert host.shape == getattr(r, n).shape and host.dtype == DTYPES[dtype]
            assert torch.equal(host, getattr(r, n).data), n
            # the layer computes over the K-row slot table, which starts with experts 0..K-1
            slots = getattr(p, n)
            assert slots.shape[0] == K and slots.data_ptr() == method.store.slots(method.layer_key, n).data_ptr()
            assert torch.equal(slots.data, host[:K])


# -- forward --------------------------------------------------------------------------------------
WAVES = {"one": (2, 3), "two": (4, 6), "many": (7, 8)}  # distinct experts per step, K = 3


@pytest.mark.parametrize("waves", WAVES)
@pytest.mark.parametrize("kind", H.KINDS)
def test_paged_forward_equals_unpaged(kind, waves):
    ref, paged = build_pair(kind, torch.bfloat16)
    rng = random.Random(hash((kind, waves)) % 1000)
    lo, hi = WAVES[waves]
    for (r, p), _step in zip(zip(H.moe_layers(ref), H.moe_layers(paged)), range(2)):
        for i in range(3):
            distinct = rng.randint(lo, hi)
            tokens = rng.randint(max(1, (distinct + 1) // 2), 9)
            ids = H.routing(rng, tokens, distinct)
            x = torch.randn(tokens, H.HIDDEN, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(i))
            topk = H.topk_output(ids, seed=i)
            before = p.quant_method.pager.read_stats()
            out = forward(p, x, topk)
            assert torch.equal(out, forward(r, x, topk))
            after = p.quant_method.pager.read_stats()
            assert after.waves - before.waves == -(-distinct // K)
            assert after.steps - before.steps == 1
            assert after.hits + after.misses - before.hits - before.misses == distinct
    total = moepage.integrations.sglang.stats(paged).total
    assert total.steps == 6 and total.bytes_paged == total.misses * H.moe_layers(paged)[0].quant_method.pager.row_bytes


def test_fp32_and_fp16_many_waves():
    for dtype in (torch.float32, torch.float16):
        ref, paged = build_pair("mixtral", dtype)
        rng = random.Random(3)
        r, p = H.moe_layers(ref)[1], H.moe_layers(paged)[1]
        for i in range(3):
            ids = H.routing(rng, 6, 8)
            x = torch.randn(6, H.HIDDEN, dtype=dtype)
            assert torch.equal(forward(p, x, H.topk_output(ids, i)), forward(r, x, H.topk_output(ids, i)))


def test_native_within_expert_order_on_larger_steps(monkeypatch):
    """SGLang's native path sorts expert ids with an unstable argsort; the paged run reproduces
    the unpaged tie order (fp32 exposes any row-order difference), with verify mode on."""
    monkeypatch.setenv("MOEPAGE_VERIFY", "1")
    ref, paged = build_pair("qwen3_moe", torch.float32)
    r, p = H.moe_layers(ref)[0], H.moe_layers(paged)[0]
    assert p.quant_method.pager.config.verify
    rng = random.Random(0)
    for tokens in (17, 64, 200):
        for i in range(2):
            ids = H.routing(rng, tokens, 8)
            x = torch.randn(tokens, H.HIDDEN)
            assert torch.equal(forward(p, x, H.topk_output(ids, i)), forward(r, x, H.topk_output(ids, i)))


def test_every_tensor_on_the_sglang_path_names_its_device(monkeypatch):
    """Issue 11: SGLang builds models under a CUDA default device, so a tensor factory called
    without ``device=`` lands on the GPU (``torch.arange`` indices on the GPU indexing CPU rows
    crashed the first engine start). Construction, loading, post-load, host-planned and
    device-planned steps and the GPTQ staging rows: no moepage factory call may rely on the
    default device."""
    from helpers.implicit_device import ImplicitDeviceGuard

    DEVICE_PLANNER_ENV = "MOEPAGE_DEVICE_PLANNER"

    monkeypatch.setenv(DEVICE_PLANNER_ENV, "1")
    rng = random.Random(7)
    with ImplicitDeviceGuard() as guard:
        ref, paged = build_pair("qwen3_moe", torch.bfloat16, k=4)
        r, p = H.moe_layers(ref)[0], H.moe_layers(paged)[0]
        for i, (tokens, distinct) in enumerate([(2, 3), (5, 8), (1, 2), (6, 7)]):  # device, host, ...
            ids = H.routing(rng, tokens, distinct)
            x = torch.randn(tokens, H.HIDDEN, dtype=torch.bfloat16)
            assert torch.equal(forward(p, x, H.topk_output(ids, i)), forward(r, x, H.topk_output(ids, i)))
        quant_pair(lambda: gptq_config(4), gptq_checkpoint(4))
    s = p.quant_method.pager.read_stats()
    assert s.steps == 4 and int(p.quant_method.pager.device_state.counters[0]) == 2  # both kinds ran
    assert guard.found == [], "tensors created on the default device:\n" + "\n".join(guard.found)


def test_eager_break_under_breakable_graph(monkeypatch):
    """Host-planned waves under the breakable prefill graph go through SGLang's eager break."""
    from moepage.integrations.sglang import compat as graphs
    from moepage.integrations.sglang.method import PagedMoeMethod

    assert hasattr(PagedMoeMethod._eager_waves, "run_eager") or callable(PagedMoeMethod._eager_waves)
    ref, paged = build_pair("qwen3_moe", torch.bfloat16)
    r, p = H.moe_layers(ref)[0], H.moe_layers(paged)[0]
    calls = []
    impl = PagedMoeMethod._eager_waves_impl
    monkeypatch.setattr(graphs, "in_breakable_graph", lambda: True)
    monkeypatch.setattr(PagedMoeMethod, "_eager_waves", lambda self, *a: (calls.append(1), impl(self, *a)))
    ids = H.routing(random.Random(1), 5, 8)
    x = torch.randn(5, H.HIDDEN, dtype=torch.bfloat16)
    assert torch.equal(forward(p, x, H.topk_output(ids)), forward(r, x, H.topk_output(ids)))
    assert calls == [1]


# -- compressed host rows (--paged-experts-compress) -----------------------------------------------
@pytest.mark.parametrize("planner", ["host", "device"])
def test_compressed_host_rows_decode_to_the_checkpoint_and_steps_equal_unpaged(planner, monkeypatch):
    """MOEPAGE_COMPRESS=1 (the flag's variable): every host tensor the code shrinks is kept coded (fewer bytes
    than bf16), decodes to the unpaged layer's rows (verify on), and steps of one, two and many waves, host-
    or device-planned, equal unpaged."""

    monkeypatch.setenv("MOEPAGE_COMPRESS", "1")
    monkeypatch.setenv("MOEPAGE_VERIFY", "1")
    monkeypatch.setenv("MOEPAGE_DEVICE_PLANNER", "1" if planner == "device" else "0")
    ref, paged = build_pair("qwen3_moe", torch.bfloat16)
    rng = random.Random(7)
    for r, p in zip(H.moe_layers(ref), H.moe_layers(paged)):
        method = p.quant_method
        assert method.config.compress and method.pager.config.device_planner == (planner == "device")
        coded = [n for n in method.names if method.pager.specs[n].code is not None]
        held = method.store.layer_bytes(method.layer_key)
        assert coded and set(held.coded) == set(coded), "no tensor was coded"
        assert held.raw == sum(getattr(r, n).nbytes for n in method.names) and held.held < held.raw
        for n in coded:
            for e in (0, H.E - 1):
                assert torch.equal(method.store.read_row(method.layer_key, n, e), getattr(r, n).data[e])
        for lo, hi in WAVES.values():
            distinct = rng.randint(lo, hi)
            ids = H.routing(rng, rng.randint(max(1, (distinct + 1) // 2), 9), distinct)
            x = torch.randn(ids.shape[0], H.HIDDEN, dtype=torch.bfloat16)
            assert torch.equal(forward(p, x, H.topk_output(ids, 1)), forward(r, x, H.topk_output(ids, 1)))


def test_compress_refuses_what_it_cannot_code():
    """The flag (its attribute on the server-args record, as the CLI sets it) on fp16 experts: refused at startup,
    naming the flag and why."""
    import moepage.errors

    with pytest.raises(moepage.errors.ConfigError, match=r"--paged-experts-compress / MOEPAGE_COMPRESS: the experts "
                                                        r"are torch.float16"):
        build_pair("mixtral", torch.float16, _moepage_paged_experts_compress=True)


def test_compress_refuses_a_store_that_codes_no_rows(monkeypatch):
    """A store without ``compresses = True`` (a user's own) is refused at startup, before any weight is loaded."""
    import types

    import moepage.errors
    from moepage.integrations import session

    monkeypatch.setattr(session, "store_for", lambda device, tier=None: types.SimpleNamespace(name="plain",
                                                                                         compresses=False))
    with pytest.raises(moepage.errors.ConfigError, match=r"MOEPAGE_COMPRESS: the plain store keeps no coded rows"):
        build_pair("qwen3_moe", torch.bfloat16, _moepage_paged_experts_compress=True)


def test_compress_keeps_float32_expert_biases_raw(monkeypatch):
    """SGLang makes expert biases float32 (``with_bias``, e.g. gpt-oss in bf16): the bf16 weights are coded, the
    biases kept raw, each reading back as loaded."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    monkeypatch.setenv("MOEPAGE_COMPRESS", "1")
    with H.server_args(**H.paged_args(3)):
        H.graph_config()
        with set_default_torch_dtype(torch.bfloat16):
            layer = FusedMoE(num_experts=8, hidden_size=64, intermediate_size=32, layer_id=0, top_k=2,
                             prefix="model.layers.0.mlp.experts", with_bias=True)
        method = layer.quant_method
        gen = torch.Generator().manual_seed(0)
        loaded = {n: torch.randn(method.rows.host(n).shape, generator=gen).to(method.rows.host(n).dtype)
                  for n in method.names}
        for n, rows in loaded.items():  # what the checkpoint loaders write
            method.rows.host(n).copy_(rows)
        method.process_weights_after_loading(layer)
    specs = method.pager.specs
    assert {n: specs[n].code is not None for n in specs} == {
        "w13_weight": True, "w2_weight": True, "w13_weight_bias": False, "w2_weight_bias": False}
    for n, rows in loaded.items():
        assert all(torch.equal(method.store.read_row(method.layer_key, n, e), rows[e]) for e in (0, 7)), n


def test_reloading_weights_into_coded_experts_is_refused(monkeypatch):
    """A second load (SGLang's weight update) would write into a decoded copy of coded rows and be lost: refused,
    saying so; the rows stay as first loaded. Without compress the same reload reaches the host rows."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    path = H.checkpoint("qwen3_moe", torch.bfloat16)
    for compress in (False, True):
        ref, paged = build_pair("qwen3_moe", torch.bfloat16, _moepage_paged_experts_compress=compress)
        method, r = H.moe_layers(paged)[0].quant_method, H.moe_layers(ref)[0]
        n = method.names[0]
        doubled = ((k, v * 2 if v.is_floating_point() else v) for k, v in H.checkpoint_weights(path))
        if compress:
            with pytest.raises(moepage.errors.ConfigError, match="reloading weights into experts kept coded"):
                DefaultModelLoader.load_weights_and_postprocess(paged, doubled, torch.device("cpu"))
            assert torch.equal(method.store.read_row(method.layer_key, n, 5), getattr(r, n).data[5])
        else:
            DefaultModelLoader.load_weights_and_postprocess(paged, doubled, torch.device("cpu"))
            assert torch.equal(method.store.read_row(method.layer_key, n, 5), getattr(r, n).data[5] * 2)
