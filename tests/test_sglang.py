"""The SGLang integration against the real sglang 0.5.23 on CPU: real FusedMoE layers of real
SGLang model classes, built and loaded from tiny random checkpoints through SGLang's own loaders,
paged through moepage's store / residency / executor, compared bit for bit with the unpaged
layers; every startup rejection; the plugin's flags, entry point and allow-list. GPU-only kernels
(Triton fused MoE, block FP8, Marlin) are tested under ``@pytest.mark.gpu``."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang.srt.layers.moe.paged_experts", reason="needs sglang==0.5.23 (ci/sglang-requirements.txt)")

import moepage  # noqa: E402
from moepage.sizing import checkpoint_size  # noqa: E402
from moepage.errors import ConfigError  # noqa: E402

import sglang_helpers as H  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
K = 3  # slots per layer: E = 8, top_k = 2


@pytest.fixture(scope="module", autouse=True)
def sglang_process():
    H.setup_sglang()


def paged_args(k=K, **more):
    return dict(enable_paged_experts=True, paged_experts_num_resident=k, **more)


def build_pair(kind, dtype, k=K, quant_config=None, **more):
    with H.server_args():
        ref = H.build_model(kind, dtype, quant_config)
    with H.server_args(**paged_args(k, **more)):
        paged = H.build_model(kind, dtype, quant_config)
    return ref, paged


def forward(layer, x, topk):
    with H.server_args():
        return layer(x, topk)


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
    for (r, p), step in zip(zip(H.moe_layers(ref), H.moe_layers(paged)), range(2)):
        for i in range(3):
            distinct = rng.randint(lo, hi)
            tokens = rng.randint(max(1, (distinct + 1) // 2), 9)
            ids = H.routing(rng, tokens, distinct)
            x = torch.randn(tokens, H.HIDDEN, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(i))
            topk = H.topk_output(ids, seed=i)
            before = p.quant_method.paged.pager.stats
            out = forward(p, x, topk)
            assert torch.equal(out, forward(r, x, topk))
            after = p.quant_method.paged.pager.stats
            assert after.waves - before.waves == -(-distinct // K)
            assert after.steps - before.steps == 1
            assert after.hits + after.misses - before.hits - before.misses == distinct
    total = moepage.integrations.sglang.stats(paged).total
    assert total.steps == 6 and total.bytes_paged == total.misses * H.moe_layers(paged)[0].quant_method.paged.pager.row_bytes


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
    assert p.quant_method.paged.pager.options.verify
    rng = random.Random(0)
    for tokens in (17, 64, 200):
        for i in range(2):
            ids = H.routing(rng, tokens, 8)
            x = torch.randn(tokens, H.HIDDEN)
            assert torch.equal(forward(p, x, H.topk_output(ids, i)), forward(r, x, H.topk_output(ids, i)))


def test_device_planned_single_wave_shares_lru_with_host_waves():
    """Steps with tokens x top_k <= K take the device planner + store.gather (the captured decode
    path; on CPU the torch planner and the torch store's gather) and share one LRU state with
    host-planned multi-wave steps."""
    from moepage.integrations.sglang.method import DEVICE_PLANNER_ENV

    os.environ[DEVICE_PLANNER_ENV] = "1"
    try:
        ref, paged = build_pair("qwen3_moe", torch.bfloat16, k=4)
    finally:
        del os.environ[DEVICE_PLANNER_ENV]
    r, p = H.moe_layers(ref)[0], H.moe_layers(paged)[0]
    state = p.quant_method.paged
    assert state.pager.device_state is not None
    rng = random.Random(5)
    for i in range(8):
        decode = i % 3 != 2
        ids = H.routing(rng, 2, rng.randint(2, 4)) if decode else H.routing(rng, 5, 8)
        x = torch.randn(ids.shape[0], H.HIDDEN, dtype=torch.bfloat16)
        before_dev = int(state.pager.device_state.counters[0])
        assert torch.equal(forward(p, x, H.topk_output(ids, i)), forward(r, x, H.topk_output(ids, i)))
        assert int(state.pager.device_state.counters[0]) - before_dev == (1 if decode else 0)
        state.pager.check_slots()  # every resident slot equals its host row
    s = state.pager.stats
    assert s.steps == 8 and s.waves == 6 * 1 + 2 * 2  # 6 device-planned steps, 2 host steps of 2 waves


@pytest.mark.parametrize("kind,k", [("qwen3_moe", 3), ("mixtral", 2), ("qwen3_moe", 4)])
def test_interleaved_host_and_captured_steps_share_one_state(kind, k, monkeypatch):
    """The serving flow on the real FusedMoE: eager host-planned steps (one, two and many waves)
    interleaved with device-planned steps taken as a decode graph takes them (``capturing()``
    true: one wave, or several for a batch above K // top_k), no Python-side state move between.
    Every output equals the unpaged layer's; every step follows one independent LRU model."""
    from conftest import RefLRU, assert_matches_ref

    import moepage.pager as pager_module

    monkeypatch.setenv("MOEPAGE_DEVICE_PLANNER", "1")
    monkeypatch.setenv("MOEPAGE_POLICY", "lru")  # checked against RefLRU
    ref, paged = build_pair(kind, torch.bfloat16, k=k)
    r, p = H.moe_layers(ref)[0], H.moe_layers(paged)[0]
    state = p.quant_method.paged
    assert state.pager.device_state is not None and state.pager.host.policy.name == "lru"
    lru = RefLRU(H.E, k)
    rng = random.Random(hash((kind, k)) % 1000)
    kinds = ["host", "captured"] * 12
    rng.shuffle(kinds)
    for i, how in enumerate(kinds):
        distinct = rng.randint(H.TOP_K, H.E)
        tokens = max(-(-distinct // H.TOP_K), k // H.TOP_K + 1) + rng.randint(0, 2)  # more than K entries
        ids = H.routing(rng, tokens, distinct)
        x = torch.randn(tokens, H.HIDDEN, dtype=torch.bfloat16)
        monkeypatch.setattr(pager_module, "capturing", lambda: how == "captured")
        out = forward(p, x, H.topk_output(ids, i))
        monkeypatch.setattr(pager_module, "capturing", lambda: False)
        assert torch.equal(out, forward(r, x, H.topk_output(ids, i))), f"step {i} ({how})"
        lru.step(set(ids.flatten().tolist()))
        assert_matches_ref(state.pager.residency, lru)
        state.pager.check_slots()
    s = state.pager.stats
    assert s.steps == len(kinds)
    assert int(state.pager.device_state.counters[0]) == kinds.count("captured")


def test_every_tensor_on_the_sglang_path_names_its_device(monkeypatch):
    """Issue 11: SGLang builds models under a CUDA default device, so a tensor factory called
    without ``device=`` lands on the GPU (``torch.arange`` indices on the GPU indexing CPU rows
    crashed the first engine start). Construction, loading, post-load, host-planned and
    device-planned steps and the GPTQ staging rows: no moepage factory call may rely on the
    default device."""
    from implicit_device import ImplicitDeviceGuard

    from moepage.integrations.sglang.method import DEVICE_PLANNER_ENV

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
    s = p.quant_method.paged.pager.stats
    assert s.steps == 4 and int(p.quant_method.paged.pager.device_state.counters[0]) == 2  # both kinds ran
    assert guard.found == [], "tensors created on the default device:\n" + "\n".join(guard.found)


def test_eager_break_under_breakable_graph(monkeypatch):
    """Host-planned waves under the breakable prefill graph go through SGLang's eager break."""
    from moepage.integrations.sglang import graphs
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


# -- startup checks -------------------------------------------------------------------------------
def bare_layer(shared=0, quant_config=None, top_k=H.TOP_K, dtype=torch.bfloat16):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    with set_default_torch_dtype(dtype):
        return FusedMoE(num_experts=H.E + shared, hidden_size=64, intermediate_size=32, layer_id=0, top_k=top_k,
                        prefix="model.layers.0.mlp.experts", num_fused_shared_experts=shared, quant_config=quant_config)


def graph_config(decode="disabled", prefill="disabled", bs=None):
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig
    from sglang.srt.runtime_context import get_context

    cfg = CudaGraphConfig(decode=PhaseConfig(backend=decode, bs=bs, max_bs=max(bs) if bs else None),
                          prefill=PhaseConfig(backend=prefill))
    get_context().override("moepage-test", cuda_graph_config=cfg)
    return cfg


def fp8_config(block=(16, 16)):
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    return Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                     weight_block_size=list(block) if block else None)


REJECTIONS = {
    "tp": (dict(tp_size=2), {}, "--tp-size=2"),
    "ep": (dict(tp_size=2, ep_size=2), {}, "--ep-size=2"),  # EP without TP is not a layout
    "pp": (dict(pp_size=2), {}, "--pp-size=2"),
    "dp": (dict(dp_size=2), {}, "--dp-size=2"),
    "eplb": (dict(enable_eplb=True), {}, "--enable-eplb"),
    "a2a": (dict(moe_a2a_backend="deepep"), {}, "--moe-a2a-backend deepep"),
    "speculative": (dict(speculative_algorithm="EAGLE"), {}, "speculative decoding"),
    "shared_fusion": ({}, dict(shared=1), "--disable-shared-experts-fusion"),
    "fused_sum_all_reduce": (dict(enable_fused_moe_sum_all_reduce=True), {}, "--enable-fused-moe-sum-all-reduce"),
    "dummy_load": (dict(load_format="dummy"), {}, "--load-format dummy"),
    "prefill_graph": ({}, dict(prefill="full"), "prefill CUDA graph backend 'full'"),
    "decode_graph": ({}, dict(decode="breakable"), "decode CUDA graph backend 'breakable'"),
    "k_below_top_k": (dict(paged_experts_num_resident=1), {}, "below the router's top_k=2"),
    "k_missing": (dict(paged_experts_num_resident=None), {}, "--paged-experts-num-resident is required"),
    "k_above_e": (dict(paged_experts_num_resident=H.E + 1), {},
                  "--paged-experts-num-resident=9 exceeds this layer's E=8 routed experts; "
                  "use K = E = 8 to keep every expert resident"),
    "format": ({}, dict(quant=True), "Fp8MoEMethod experts are not supported (only as block FP8"),
    "runner_backend": (dict(moe_runner_backend="flashinfer_cutlass"), {}, "--moe-runner-backend flashinfer_cutlass"),
}


def _reject(args: dict, layer: dict):
    fields = {**paged_args(), **args}
    with H.server_args(**fields):
        graph_config(layer.get("decode", "disabled"), layer.get("prefill", "disabled"))
        qc = fp8_config(block=None) if layer.get("quant") else None
        with pytest.raises(ConfigError) as info:
            bare_layer(shared=layer.get("shared", 0), quant_config=qc)
    return str(info.value)


@pytest.mark.parametrize("case", REJECTIONS)
def test_startup_rejection(case):
    args, layer, expected = REJECTIONS[case]
    message = _reject(args, layer)
    assert expected in message
    assert message.count("\n  - ") == (2 if case == "ep" else 1), message  # exactly this problem


def test_startup_rejections_listed_together():
    args, layer = {}, {}
    for a, lay, _ in REJECTIONS.values():
        if "paged_experts_num_resident" not in a:
            args.update(a)
            layer.update(lay)
    args["paged_experts_num_resident"] = 1
    message = _reject(args, layer)
    for case, (_, _, expected) in REJECTIONS.items():
        if case not in ("k_missing", "k_above_e"):  # K is 1 here
            assert expected in message, case
    assert "supported formats: unquantized bf16/fp16/fp32, block FP8 (Triton)" in message
    assert "GPTQ int4/int8 (Marlin)" in message


def test_k_equal_to_e_keeps_every_expert_resident():
    """K = E is the way to keep everything resident (K = E + 1 is refused above, as by wrap)."""
    with H.server_args(**paged_args(k=H.E)):
        graph_config()
        layer = bare_layer()
    assert layer.quant_method.num_slots == H.E and layer.w13_weight.shape[0] == H.E


def test_shared_state_released_with_the_model():
    """Stores, layer names and the auto K live while a paged model does: when the model goes
    away its rows are released and the stores closed, and the next model starts clean."""
    import gc

    from moepage.integrations.sglang import session
    from moepage.integrations.sglang.method import paged_methods
    from moepage.store import RowSpec

    gc.collect()
    assert session.state()["live"] == 0 and session.state()["names"] == []
    _, first = build_pair("mixtral", torch.bfloat16)
    keys = [m.layer_key for m in paged_methods(first)]
    store = paged_methods(first)[0].store
    _, second = build_pair("mixtral", torch.bfloat16)  # alive together: names are made unique
    assert [m.layer_key for m in paged_methods(second)] == [k + "#2" for k in keys]
    session.CHOSEN[("m", 8, 2)] = 4  # what auto would have chosen
    assert session.state()["live"] == 4 and len(keys) == 2
    del second
    gc.collect()
    assert session.state()["live"] == 2 and session.state()["names"] == sorted(keys)
    assert store.host_bytes() == 2 * H.E * paged_methods(first)[0].paged.pager.row_bytes  # only first's rows
    del first
    gc.collect()
    assert session.state() == dict(live=0, stores={}, names=[], chosen={})
    with pytest.raises(ConfigError, match="closed"):
        store.allocate("x", {"w": RowSpec((1,), torch.float32)}, 1, 1, torch.device("cpu"))
    _, third = build_pair("mixtral", torch.bfloat16)
    assert [m.layer_key for m in paged_methods(third)] == keys  # names restart
    assert paged_methods(third)[0].store is not store


def test_unquantized_dtype_rejected():
    with H.server_args(**paged_args()):
        graph_config()
        with pytest.raises(ConfigError, match="unquantized experts of dtype torch.float64"):
            bare_layer(dtype=torch.float64)


def test_decode_graphs_need_a_gathering_store(monkeypatch):
    """A full decode graph captures device-planned steps: a store that cannot gather a device-made
    plan (here a pinned torch store, as on CUDA without cuda-python) is refused at startup."""
    from moepage.backends.torch import TorchStore
    from moepage.integrations.sglang import method

    with H.server_args(**paged_args()):
        graph_config(decode="full", bs=[1, 2, 4])
        monkeypatch.setattr(method, "store_for", lambda device: TorchStore(pin_memory=True))
        with pytest.raises(ConfigError, match="decode CUDA graphs need a store that pages device-made plans"):
            bare_layer()


def test_decode_capture_sizes_are_not_capped():
    """Decode steps of more than K entries run as device-planned waves inside the graph, so every
    capture batch size stays (SGLang's built-in caps them at K // top_k)."""
    with H.server_args(**paged_args(k=6)):
        cfg = graph_config(decode="full", prefill="breakable", bs=[1, 2, 4, 8, 16, 32])
        layer = bare_layer()
        from sglang.srt.runtime_context import get_exec

        decode = get_exec().graph.cuda_graph_config.decode
        assert decode.bs == [1, 2, 4, 8, 16, 32]
        assert layer.quant_method.num_slots == 6
        del cfg


def test_impl_sglang_selects_the_builtin(monkeypatch):
    from sglang.srt.layers.moe.paged_experts import store as builtin_store
    from sglang.srt.layers.moe.paged_experts.method import PagedExpertsMoEMethod

    from moepage.integrations.sglang.plugin import IMPL_ATTR

    # The built-in store pins host memory, which needs a CUDA driver: pageable memory here.
    monkeypatch.setattr(builtin_store.HostExpertStore, "_alloc", lambda self, shape, dtype: torch.empty(shape, dtype=dtype))
    with H.server_args(**paged_args(), **{IMPL_ATTR: "sglang"}):
        graph_config()
        assert isinstance(bare_layer().quant_method, PagedExpertsMoEMethod)
    monkeypatch.setenv("MOEPAGE_SGLANG_IMPL", "sglang")
    with H.server_args(**paged_args()):
        graph_config()
        assert isinstance(bare_layer().quant_method, PagedExpertsMoEMethod)
    with H.server_args(**paged_args(), **{IMPL_ATTR: "moepage"}):
        graph_config()
        assert type(bare_layer().quant_method).__name__ == "PagedMoeMethod"


# -- quantized formats: loader placement and host rows ---------------------------------------------
FMT_E, FMT_H, FMT_I, GROUP = 8, 64, 32, 16


def load_experts(layer, ckpt: dict) -> None:
    """Feed checkpoint tensors through SGLang's expert mapping and the parameters' real weight
    loaders, as a model's ``load_weights`` does."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    mapping = FusedMoE.make_expert_params_mapping(
        ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj", ckpt_up_proj_name="up_proj",
        num_experts=FMT_E,
    )
    prefix = "model.layers.0.mlp.experts"
    params = dict(layer.named_parameters(prefix=prefix))
    for name, tensor in ckpt.items():
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name in name:
                target = name.replace(weight_name, param_name)
                param = params[target]
                param.weight_loader(param, tensor, target, shard_id=shard_id, expert_id=expert_id)
                break
        else:
            raise KeyError(name)


def fp8_block_checkpoint(seed=0):
    g = torch.Generator().manual_seed(seed)
    ckpt = {}
    for e in range(FMT_E):
        for proj, shape in (("gate_proj", (FMT_I, FMT_H)), ("up_proj", (FMT_I, FMT_H)), ("down_proj", (FMT_H, FMT_I))):
            pre = f"model.layers.0.mlp.experts.{e}.{proj}."
            ckpt[pre + "weight"] = torch.randn(shape, generator=g).to(torch.float8_e4m3fn)
            ckpt[pre + "weight_scale_inv"] = torch.rand((shape[0] // 16, shape[1] // 16), generator=g)
    return ckpt


def gptq_checkpoint(bits: int, seed=0):
    g = torch.Generator().manual_seed(seed)
    pack = 32 // bits
    ckpt = {}
    for e in range(FMT_E):
        for proj, (inp, out) in (("gate_proj", (FMT_H, FMT_I)), ("up_proj", (FMT_H, FMT_I)), ("down_proj", (FMT_I, FMT_H))):
            pre = f"model.layers.0.mlp.experts.{e}.{proj}."
            ckpt[pre + "qweight"] = torch.randint(-2**31, 2**31 - 1, (inp // pack, out), dtype=torch.int32, generator=g)
            ckpt[pre + "scales"] = torch.rand((inp // GROUP, out), generator=g).half()
            ckpt[pre + "qzeros"] = torch.randint(-2**31, 2**31 - 1, (inp // GROUP, out // pack), dtype=torch.int32, generator=g)
            ckpt[pre + "g_idx"] = (torch.arange(inp) // GROUP).int()
    return ckpt


def gptq_config(bits: int):
    from sglang.srt.layers.quantization.gptq.gptq import GPTQMarlinConfig

    return GPTQMarlinConfig.from_config(
        {"bits": bits, "group_size": GROUP, "desc_act": False, "sym": True, "lm_head": False, "quant_method": "gptq"}
    )


def quant_pair(make_config, ckpt):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    def layer():
        with set_default_torch_dtype(torch.bfloat16):
            return FusedMoE(num_experts=FMT_E, hidden_size=FMT_H, intermediate_size=FMT_I, layer_id=0, top_k=2,
                            prefix="model.layers.0.mlp.experts", quant_config=make_config())

    with H.server_args():
        ref = layer()
        load_experts(ref, ckpt)
    with H.server_args(**paged_args()):
        graph_config()
        paged = layer()
        load_experts(paged, ckpt)
    return ref, paged


def test_fp8_block_host_rows_and_post_load():
    ref, paged = quant_pair(fp8_config, fp8_block_checkpoint())
    method = paged.quant_method
    assert method.contract.name == "triton" and not method.contract.repacks
    assert set(method.names) == {"w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"}
    for n in method.names:
        assert method.store.host_rows(method.layer_key, n).shape[0] == FMT_E
        assert torch.equal(method.store.host_rows(method.layer_key, n).view(torch.uint8), getattr(ref, n).data.view(torch.uint8)), n
    with H.server_args():
        ref.quant_method.process_weights_after_loading(ref)
        method.process_weights_after_loading(paged)  # the base step runs, and keeps the layout
    for n in method.names:
        assert torch.equal(getattr(paged, n).data.view(torch.uint8), getattr(ref, n).data[:K].view(torch.uint8))


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_loaders_write_staged_host_rows(bits):
    """GPTQ (Marlin) repacks after loading: its checkpoint rows are staged on the host for the
    K-at-a-time repack (which needs the CUDA Marlin kernels: see the GPU test)."""
    ref, paged = quant_pair(lambda: gptq_config(bits), gptq_checkpoint(bits, seed=bits))
    method = paged.quant_method
    assert method.contract.name == "marlin" and method.contract.repacks
    assert method.format.unpaged == ("w13_qzeros", "w2_qzeros")
    loaded = ["w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "w13_qzeros", "w2_qzeros", "w13_g_idx", "w2_g_idx"]
    for n in loaded:
        assert method.staging[n].shape == (FMT_E, *getattr(ref, n).shape[1:])
        assert torch.equal(method.staging[n], getattr(ref, n).data), n
    assert getattr(paged, "w13_qweight").shape[0] == K


class _RepackingMethod:
    """A post-load step that repacks every expert on its own into a new layout (what Marlin does),
    or, with ``mix``, one that mixes experts (a max over them)."""

    def __init__(self, mix=False):
        self.mix = mix

    def process_weights_after_loading(self, layer):
        w = layer.w13_weight.data
        packed = w.transpose(1, 2).flip(-1).contiguous() * 2
        if self.mix:
            packed = packed / w.abs().amax()
        layer.w13_weight = torch.nn.Parameter(packed, requires_grad=False)
        layer.repacked = True


@pytest.mark.parametrize("num_experts", [8, 7])
def test_repack_k_experts_at_a_time(num_experts):
    from moepage.backends.torch import TorchStore
    from moepage.integrations.sglang import postload

    with H.server_args():
        layer = bare_layer()  # an unpaged FusedMoE; its tensors serve as the K-row templates
    k = 3
    layer.w13_weight = torch.nn.Parameter(layer.w13_weight.data[:k].clone(), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(layer.w2_weight.data[:k].clone(), requires_grad=False)
    staged = {n: torch.randn(num_experts, *getattr(layer, n).shape[1:]).to(torch.bfloat16) for n in ("w13_weight", "w2_weight")}
    store = TorchStore(pin_memory=False)

    def allocate(specs):
        store.allocate("L", specs, num_experts, k, torch.device("cpu"))
        return lambda n: store.host_rows("L", n)

    names = postload.repack(layer, _RepackingMethod(), staged, k, (), allocate)
    assert set(names) == {"w13_weight", "w2_weight"}
    assert torch.equal(store.host_rows("L", "w13_weight"), staged["w13_weight"].transpose(1, 2).flip(-1) * 2)
    assert torch.equal(store.host_rows("L", "w2_weight"), staged["w2_weight"])
    layer.w13_weight = torch.nn.Parameter(layer.w13_weight.data.transpose(1, 2).flip(1).contiguous() / 2, requires_grad=False)
    with pytest.raises(ConfigError, match="does not treat each expert on its own"):
        postload.repack(layer, _RepackingMethod(mix=True), staged, k, (), lambda specs: (lambda n: torch.empty(num_experts, *specs[n].shape, dtype=specs[n].dtype)))


def test_keep_layout_refuses_a_transforming_post_load_step():
    from moepage.integrations.sglang import postload

    class Doubles:
        def process_weights_after_loading(self, layer):
            layer.w13_weight.data.mul_(2)

    with H.server_args():
        layer = bare_layer()
    host = {n: getattr(layer, n).data.clone().normal_() for n in ("w13_weight", "w2_weight")}
    slots = {n: getattr(layer, n).data for n in host}
    with pytest.raises(ConfigError, match="transforms w13_weight"):
        postload.keep_layout(layer, Doubles(), list(host), host.__getitem__, slots.__getitem__, H.E)


# -- --paged-experts-num-resident auto ------------------------------------------------------------
def test_auto_sizing_reads_expert_bytes_from_safetensors_headers():
    from moepage.integrations.sglang import sizing

    path = H.checkpoint("qwen3_moe", torch.bfloat16)
    ckpt = checkpoint_size(path)
    per_expert = 3 * H.INTER * H.HIDDEN * 2  # gate, up, down in bf16
    assert ckpt.num_layers == 2 and ckpt.expert_bytes == [per_expert, per_expert]
    total = sum(t.numel() * t.element_size() for _, t in H.checkpoint_weights(path))
    assert ckpt.dense_bytes == total - 2 * H.E * per_expert
    per_slot = per_expert * 2
    gpu = 10 * per_slot + ckpt.dense_bytes  # budget: fraction 1.0, no KV reserve -> 10 slots
    k, fig = sizing.choose_resident(ckpt, H.E, H.TOP_K, gpu, 1.0, 0.0)
    assert k == H.E and fig["fits"] == 10  # clamped to E
    k, fig = sizing.choose_resident(ckpt, H.E, H.TOP_K, 5 * per_slot + ckpt.dense_bytes, 1.0, 0.0)
    assert k == 5
    k, _ = sizing.choose_resident(ckpt, H.E, H.TOP_K, 2 * (5 * per_slot + ckpt.dense_bytes), 0.5, 0.0)
    assert k == 5
    with pytest.raises(ConfigError, match="top_k=2 are needed"):
        sizing.choose_resident(ckpt, H.E, H.TOP_K, per_slot + ckpt.dense_bytes, 1.0, 0.0)


def test_auto_resident_on_a_server(monkeypatch, caplog):
    """``auto`` through make_for_layer: K from the (faked) GPU size, logged; needs CUDA otherwise."""
    from moepage.integrations.sglang import method, sizing

    path = H.checkpoint("mixtral", torch.bfloat16)
    ckpt = checkpoint_size(path)
    per_slot = ckpt.slot_bytes
    gpu = int((4 * per_slot + ckpt.dense_bytes) / 0.75 / 0.5) + 1  # fraction 0.5, 25 % KV reserve -> K = 4

    def fake(num_experts, top_k, device):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": gpu})())
        monkeypatch.setattr(sizing, "_mem_fraction_static", lambda: 0.5)
        return real(num_experts, top_k, torch.device("cuda"))

    real = sizing.auto_resident
    monkeypatch.setattr(method, "auto_resident", fake)
    with H.server_args(**paged_args(k="auto", model_path=path)):
        graph_config()
        with caplog.at_level(logging.INFO, logger="moepage.sglang"):
            layer = bare_layer()
    assert layer.quant_method.num_slots == 4
    assert "--paged-experts-num-resident auto chose K=4 of 8 experts" in caplog.text
    with H.server_args(**paged_args(k="auto", model_path=path)):
        graph_config()
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            sizing.auto_resident(H.E, H.TOP_K, torch.device("cpu"))


def test_kv_reserve_fraction_env_is_checked(monkeypatch):
    """A bad MOEPAGE_KV_RESERVE_FRACTION names the variable (was: a bare float() ValueError)."""
    from moepage.integrations.sglang import session, sizing

    path = H.checkpoint("mixtral", torch.bfloat16)
    monkeypatch.setattr(session, "CHOSEN", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 1 << 34})())
    monkeypatch.setattr(sizing, "_mem_fraction_static", lambda: 0.5)
    monkeypatch.setenv("MOEPAGE_KV_RESERVE_FRACTION", "25%")
    with H.server_args(**paged_args(k="auto", model_path=path)):
        with pytest.raises(ConfigError, match=r"MOEPAGE_KV_RESERVE_FRACTION='25%' is not a number in \[0, 1\)"):
            sizing.auto_resident(H.E, H.TOP_K, torch.device("cuda"))


@pytest.mark.parametrize("value,on", [("true", True), ("off", False)])
def test_device_planner_env_reads_flags(monkeypatch, value, on):
    """MOEPAGE_DEVICE_PLANNER takes any flag spelling (``true`` used to mean off)."""
    from moepage.integrations.sglang.method import DEVICE_PLANNER_ENV

    monkeypatch.setenv(DEVICE_PLANNER_ENV, value)
    _, paged = build_pair("qwen3_moe", torch.bfloat16, k=4)
    assert (H.moe_layers(paged)[0].quant_method.paged.pager.device_state is not None) is on


def test_backend_env_is_checked(monkeypatch):
    from moepage.integrations.sglang import method, session

    monkeypatch.setattr(session, "_STORES", {})
    monkeypatch.setenv("MOEPAGE_BACKEND", "gpu")
    with pytest.raises(ConfigError, match=r"MOEPAGE_BACKEND='gpu' is not one of cuda, mock, torch"):
        method.store_for(torch.device("cpu"))
    monkeypatch.setenv("MOEPAGE_BACKEND", "mock")
    assert method.store_for(torch.device("cpu")).name == "mock"


# -- plugin: entry point, flags, allow-list --------------------------------------------------------
def _plugin_env(tmp_path, allow: str | None) -> dict:
    """Environment for a fresh SGLang process that discovers the plugin through its entry point.
    Where the installed moepage does not declare it yet, a dist-info on PYTHONPATH declares the
    same entry point as pyproject.toml."""
    from moepage.integrations.sglang import ENTRY_POINT_GROUP, ENTRY_POINT_NAME

    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    paths = [str(Path(__file__).resolve().parents[1])]
    declared = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == ENTRY_POINT_NAME]
    if not declared:
        info = tmp_path / "moepage_sglang_entrypoint-0.0.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: moepage-sglang-entrypoint\nVersion: 0.0\n")
        (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{ENTRY_POINT_NAME} = moepage.integrations.sglang:register\n")
        paths.append(str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    if allow is not None:
        env["SGLANG_PLUGINS"] = allow
    return env


@pytest.mark.parametrize("policy,half_life", [(None, 1024), ("lru", 0), ("lfru:8", 8)])
def test_policy_setting_reaches_the_layers(monkeypatch, policy, half_life):
    """--paged-experts-policy (here through its record attribute) or MOEPAGE_POLICY picks the
    eviction policy of every layer, default moepage.DEFAULT_POLICY (lfu, H = 1024)."""
    from moepage.integrations.sglang.plugin import POLICY_ATTR

    monkeypatch.setenv("MOEPAGE_DEVICE_PLANNER", "1")
    record = {POLICY_ATTR: policy} if policy else {}
    with H.server_args(**paged_args(4), **record):
        graph_config()
        layer = bare_layer()
    assert layer.quant_method.policy.half_life == half_life


def test_bad_policy_is_refused_at_startup(monkeypatch):
    monkeypatch.setenv("MOEPAGE_POLICY", "mru")
    with H.server_args(**paged_args()):
        graph_config()
        with pytest.raises(ConfigError, match=r"MOEPAGE_POLICY: unknown policy 'mru'"):
            bare_layer()


def test_flags_in_launch_server_help(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], env=_plugin_env(tmp_path, None),
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    text = " ".join(out.stdout.split())
    assert "--paged-experts-impl {moepage,sglang}" in text and "--paged-experts-policy" in text and "--paged-experts-prefetch" in text
    assert "--enable-paged-experts" in text and "--paged-experts-num-resident {K,auto}" in text


PROBE = textwrap.dedent("""
    import pickle
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args, ServerArgs
    import argparse
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    print("HAS_FLAG", "--paged-experts-impl" in parser.format_help())
    try:
        a = prepare_server_args(["--model-path", "m", "--enable-paged-experts", "--paged-experts-num-resident",
                                 "auto", "--paged-experts-impl", "sglang", "--paged-experts-policy", "lfru"])
    except SystemExit:
        print("PARSE_FAILED")
    else:
        b = pickle.loads(pickle.dumps(a))  # how the record reaches the scheduler processes
        print("PARSED", b.paged_experts_num_resident, getattr(b, "_moepage_paged_experts_impl", None),
              getattr(b, "_moepage_paged_experts_policy", None))
""")


@pytest.mark.parametrize("allow", ["moepage", "some_other_plugin"])
def test_plugin_loads_through_entry_point_and_respects_allow_list(tmp_path, allow):
    out = subprocess.run([sys.executable, "-c", PROBE], env=_plugin_env(tmp_path, allow), capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    if allow == "moepage":
        assert "HAS_FLAG True" in out.stdout and "PARSED auto sglang lfru" in out.stdout, out.stdout
    else:
        assert "HAS_FLAG False" in out.stdout and "PARSE_FAILED" in out.stdout, out.stdout


def _defines_method(module: str, cls: str, method: str) -> bool:
    """Whether the installed sglang's ``module`` defines ``cls.method`` (read, not imported:
    the scheduler needs packages the CPU install lacks)."""
    import ast
    import importlib.util

    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    return any(
        isinstance(node, ast.ClassDef) and node.name == cls
        and any(isinstance(f, ast.FunctionDef) and f.name == method for f in node.body)
        for node in tree.body
    )


def test_stats_dump_hook_only_when_asked(monkeypatch):
    from moepage.integrations.sglang import dump, plugin

    monkeypatch.delenv(dump.PATH_ENV, raising=False)
    assert [t for t, _, _ in plugin.hooks()] == [plugin.ADD_CLI_ARGS, plugin.FROM_CLI_ARGS, plugin.MAKE_FOR_LAYER,
                                                 plugin.POSTPROCESS]
    monkeypatch.setenv(dump.PATH_ENV, "/tmp/x.json")
    assert (dump.FLUSH_CACHE, dump.after_flush, "AFTER") in plugin.hooks()
    module, cls, method = dump.FLUSH_CACHE.rsplit(".", 2)
    assert _defines_method(module, cls, method)  # the hook's target exists in sglang 0.5.23
    assert _defines_method("sglang.srt.entrypoints.engine", "Engine", "flush_cache")  # what callers call


def test_stats_dump_writes_every_paged_layer(tmp_path, monkeypatch):
    """The dump an Engine caller reads: each paged layer's E, K and counters, and their total."""
    import json

    from moepage.integrations.sglang import dump

    path = tmp_path / "stats.json"
    monkeypatch.setenv(dump.PATH_ENV, str(path))
    ref, paged = build_pair("qwen3_moe", torch.bfloat16)
    rng = random.Random(2)
    for layer in H.moe_layers(paged):
        ids = H.routing(rng, 4, 7)
        forward(layer, torch.randn(4, H.HIDDEN, dtype=torch.bfloat16), H.topk_output(ids))
    assert dump.after_flush(True, object()) is True  # the flush's own result passes through
    first = json.loads(path.read_text())
    keys = [m.quant_method.layer_key for m in H.moe_layers(paged)]
    assert list(first["layers"]) == keys
    for key, layer in zip(keys, H.moe_layers(paged)):
        got = first["layers"][key]
        want = layer.quant_method.paged.pager.stats
        assert (got["num_experts"], got["num_slots"]) == (H.E, K)
        assert (got["steps"], got["waves"], got["hits"], got["misses"]) == (1, 3, want.hits, want.misses)
        assert got["hits"] + got["misses"] == 7
    assert first["total"]["misses"] == moepage.integrations.sglang.stats(paged).total.misses
    dump.after_flush(None)
    assert json.loads(path.read_text())["seq"] == first["seq"] + 1


def test_pyproject_declares_the_entry_point():
    import tomllib

    from moepage.integrations.sglang import ENTRY_POINT_GROUP, ENTRY_POINT_NAME

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {}).get(ENTRY_POINT_NAME) == "moepage.integrations.sglang:register"


# -- GPU: SGLang's CUDA kernels (Triton fused MoE, block FP8, Marlin) -------------------------------
def _sgl_kernel() -> bool:
    try:
        import sgl_kernel  # noqa: F401
    except Exception:
        return False
    return True


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (SGLang's fused-MoE kernels are CUDA-only)")
needs_sgl_kernel = pytest.mark.skipif(not _sgl_kernel(), reason="needs sgl_kernel (sglang-kernel), which SGLang's CUDA MoE path imports")


def _gpu_pair(make_config, ckpt, k=K, graphs=None):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    def layer():
        with set_default_torch_dtype(torch.bfloat16), torch.device("cuda"):
            return FusedMoE(num_experts=FMT_E, hidden_size=FMT_H, intermediate_size=FMT_I, layer_id=0, top_k=2,
                            prefix="model.layers.0.mlp.experts", quant_config=make_config() if make_config else None)

    with H.server_args():
        ref = layer()
        load_experts(ref, ckpt)
        ref.quant_method.process_weights_after_loading(ref)
    with H.server_args(**paged_args(k)):
        graph_config(*(graphs or ("disabled", "disabled")))
        paged = layer()
        load_experts(paged, ckpt)
        paged.quant_method.process_weights_after_loading(paged)
    return ref, paged


def _bf16_checkpoint(seed=0):
    g = torch.Generator().manual_seed(seed)
    ckpt = {}
    for e in range(FMT_E):
        for proj, shape in (("gate_proj", (FMT_I, FMT_H)), ("up_proj", (FMT_I, FMT_H)), ("down_proj", (FMT_H, FMT_I))):
            ckpt[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = (torch.randn(shape, generator=g) * 0.2).bfloat16()
    return ckpt


def _compare_on_gpu(ref, paged, steps=6):
    rng = random.Random(0)
    for i, (tokens, distinct) in enumerate([(1, 2), (2, 3), (5, 6), (9, 8), (3, 5), (16, 8)][:steps]):
        ids = H.routing(rng, tokens, distinct).cuda()
        topk = H.topk_output(ids.cpu(), i)
        topk = topk._replace(topk_weights=topk.topk_weights.cuda(), topk_ids=ids)
        x = torch.randn(tokens, FMT_H, dtype=torch.bfloat16, device="cuda")
        assert torch.equal(forward(paged, x, topk), forward(ref, x, topk)), (tokens, distinct)


@pytest.mark.gpu
@needs_sgl_kernel
@needs_cuda
def test_gpu_triton_unquantized_paged_equals_unpaged():
    ref, paged = _gpu_pair(None, _bf16_checkpoint())
    assert paged.quant_method.contract.name == "triton"
    _compare_on_gpu(ref, paged)


@pytest.mark.gpu
@needs_sgl_kernel
@needs_cuda
def test_gpu_triton_block_fp8_paged_equals_unpaged():
    ref, paged = _gpu_pair(fp8_config, fp8_block_checkpoint())
    _compare_on_gpu(ref, paged)


@pytest.mark.gpu
@needs_sgl_kernel
@needs_cuda
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_gptq_marlin_repacked_k_at_a_time(bits):
    ref, paged = _gpu_pair(lambda: gptq_config(bits), gptq_checkpoint(bits, seed=bits))
    method = paged.quant_method
    assert method.contract.name == "marlin" and "w13_qzeros" not in method.paged.pager.specs
    _compare_on_gpu(ref, paged)


@pytest.mark.gpu
@needs_sgl_kernel
@needs_cuda
def test_gpu_triton_captured_decode_between_eager_steps():
    """The serving flow on SGLang's Triton runner: a decode step of 2 tokens x top-2 = 4 entries
    > K = 3 (two device waves) captured in a CUDA graph the way SGLang's runner captures it
    (warm-up and capture in capture mode), replayed on fresh routing between eager host-planned
    steps. Every output equals the unpaged layer's."""
    import moepage.pager as pager_module

    ref, paged = _gpu_pair(None, _bf16_checkpoint(3), graphs=("full", "disabled"))
    assert paged.quant_method.paged.pager.device_state is not None
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


def test_per_layer_split_from_a_file(monkeypatch, tmp_path):
    """--paged-experts-split / MOEPAGE_SPLIT: the i-th MoE layer keeps the file's K; with another
    total (the flag's K times the layers) the file's curves are re-split; a bad file is refused."""
    import gc
    import json

    from moepage import budgets
    from moepage.integrations.sglang import session

    gc.collect()
    assert session.state()["live"] == 0  # layer indices count from this model's first layer
    curves = {"0": [9, 6, 2, 1, 0, 0, 0], "1": [4, 3, 2, 1, 0, 0, 0]}  # misses at K = 2..8
    path = tmp_path / "split.json"
    path.write_text(json.dumps({"layers": {"0": 3, "1": 5}, "budget": 8, "top_k": 2, "curves": curves}))
    monkeypatch.setenv("MOEPAGE_SPLIT", str(path))
    ref, paged = build_pair("qwen3_moe", torch.bfloat16, k=4)  # 2 layers x 4: the file's own total
    assert [m.quant_method.num_slots for m in H.moe_layers(paged)] == [3, 5]
    rng = random.Random(3)
    for r, p in zip(H.moe_layers(ref), H.moe_layers(paged)):
        for i in range(3):
            ids = H.routing(rng, 6, 7)
            x = torch.randn(6, H.HIDDEN, dtype=torch.bfloat16)
            assert torch.equal(forward(p, x, H.topk_output(ids, i)), forward(r, x, H.topk_output(ids, i)))
    del ref, paged, r, p
    gc.collect()
    _, paged = build_pair("qwen3_moe", torch.bfloat16, k=3)  # a total of 6: re-split from the curves
    assert [m.quant_method.num_slots for m in H.moe_layers(paged)] == budgets.allocate(list(curves.values()), 6, 2)
    del paged
    gc.collect()
    path.write_text(json.dumps({"layers": {"0": 3}, "budget": 3}))
    with pytest.raises(ConfigError, match=r"no K for MoE layer 1"):
        build_pair("qwen3_moe", torch.bfloat16, k=3)


@pytest.mark.parametrize("graphs", [("full", "disabled"), ("disabled", "breakable")])
def test_marlin_with_cuda_graphs_is_refused(graphs):
    """The Marlin contract reads a wave's entry count on the host: no capture yet, said at startup."""
    with H.server_args(**paged_args()):
        graph_config(*graphs)
        with pytest.raises(ConfigError, match=r"GPTQ int4/int8 \(Marlin\) steps read their entry count on the host"):
            bare_layer(quant_config=gptq_config(4), dtype=torch.float16)
        graph_config("disabled", "disabled")
        assert bare_layer(quant_config=gptq_config(4), dtype=torch.float16).quant_method.num_slots == K


# -- next-layer prefetch (--paged-experts-prefetch) -----------------------------------------------
@pytest.mark.parametrize("value,parsed", [(None, False), ("off", False), ("on", True), ("ON", True), ("3", 3), (2, 2)])
def test_prefetch_flag_values(value, parsed):
    from moepage.integrations.sglang.prefetch import parse

    assert parse(value) == parsed


@pytest.mark.parametrize("bad", ["0", "-1", "yes", "2.5"])
def test_bad_prefetch_is_refused_at_startup(monkeypatch, bad):
    monkeypatch.setenv("MOEPAGE_SGLANG_PREFETCH", bad)
    with H.server_args(**paged_args()):
        graph_config()
        with pytest.raises(ConfigError, match=r"--paged-experts-prefetch / MOEPAGE_SGLANG_PREFETCH: .*off, on"):
            bare_layer()


def test_prefetch_flag_reaches_the_layers_and_refuses_an_unlinked_forward(monkeypatch):
    """The record attribute (the CLI flag) sets it; a layer never linked by the post-load hook
    (here: built alone, never loaded through DefaultModelLoader) refuses to run rather than
    silently not prefetching."""
    from moepage.integrations.sglang.plugin import PREFETCH_ATTR

    with H.server_args(**paged_args(), **{PREFETCH_ATTR: "5"}):
        graph_config()
        layer = bare_layer()
    assert layer.quant_method.prefetch == 5 and not layer.quant_method.prefetch_linked
    with pytest.raises(ConfigError, match=r"never linked"):
        layer.quant_method.apply(layer, None)


def _gate(model, i):
    return [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")][i].gate


@pytest.mark.parametrize("kind,value", [("qwen3_moe", "on"), ("mixtral", "2")])
def test_prefetch_links_layers_and_keeps_outputs(kind, value, monkeypatch):
    """Prefetch on real FusedMoE layers loaded through SGLang's loader (linked by the post-load
    hook): layer 0's step pages in what layer 1's router predicts from layer 0's input. Layer 1
    is routed by its own router on that same input, so the prediction is exact: a step of at most K
    distinct experts then misses nothing in layer 1. Host-planned, device-planned and "captured"
    steps interleave; every output equals the unpaged model's."""
    import moepage.pager as pager_module
    from moepage.prefetch import PrefetchLink

    monkeypatch.setenv("MOEPAGE_DEVICE_PLANNER", "1")
    monkeypatch.setenv("MOEPAGE_SGLANG_PREFETCH", value)
    k = 4
    ref, paged = build_pair(kind, torch.bfloat16, k=k)
    (r0, r1), (p0, p1) = H.moe_layers(ref), H.moe_layers(paged)
    s0, s1 = p0.quant_method.paged, p1.quant_method.paged
    assert isinstance(s0.link, PrefetchLink) and s0.link.target is s1.pager and s1.link is None
    assert s1.pager.device_state is not None
    gate = _gate(paged, 1)
    rng = random.Random(hash((kind, value)) % 1000)
    kinds = ["host", "device", "captured"] * 6
    rng.shuffle(kinds)
    exact = 0
    for i, how in enumerate(kinds):
        tokens = rng.randint(1, 2) if how == "device" else rng.randint(3, 6)
        x = torch.randn(tokens, H.HIDDEN, dtype=torch.bfloat16)
        ids0 = H.routing(rng, tokens, rng.randint(H.TOP_K, min(H.E, tokens * H.TOP_K)))
        ids1 = torch.topk(torch.nn.functional.linear(x, gate.weight), H.TOP_K, dim=-1).indices.to(torch.int32)
        monkeypatch.setattr(pager_module, "capturing", lambda: how == "captured")
        out0 = forward(p0, x, H.topk_output(ids0, i))
        before = s1.pager.stats
        out1 = forward(p1, x, H.topk_output(ids1, i))
        after = s1.pager.stats
        monkeypatch.setattr(pager_module, "capturing", lambda: False)
        assert torch.equal(out0, forward(r0, x, H.topk_output(ids0, i))), f"step {i} ({how}), layer 0"
        assert torch.equal(out1, forward(r1, x, H.topk_output(ids1, i))), f"step {i} ({how}), layer 1"
        if len(set(ids1.flatten().tolist())) <= k:
            assert after.misses == before.misses, f"step {i} ({how}): layer 1 missed a prefetched expert"
            exact += 1
        s0.pager.check_slots()
        s1.pager.check_slots()
    assert exact >= 3  # the device steps at least (at most 2 tokens: at most K = 4 experts)
    stats = moepage.integrations.sglang.stats(paged)
    assert stats.total.prefetched > 0 and s0.pager.stats.prefetched == 0  # nothing prefetches into layer 0


def test_prefetch_without_a_router_is_refused_by_name(monkeypatch):
    from moepage.integrations.sglang.prefetch import link_model

    monkeypatch.setenv("MOEPAGE_SGLANG_PREFETCH", "on")
    _, paged = build_pair("qwen3_moe", torch.bfloat16)
    blocks = [m for m in paged.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    blocks[1].gate = torch.nn.Identity()
    name = H.moe_layers(paged)[1].quant_method.layer_key
    with pytest.raises(ConfigError, match=rf"layer {name} .*no router"):
        link_model(paged)
