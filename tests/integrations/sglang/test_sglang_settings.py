"""moepage's SGLang settings: auto K from the checkpoint's headers, the environment, the plugin's
entry point, flags and allow-list, policies, the stats dump, per-layer splits, next-layer
prefetch."""

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
import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)
import torch

import moepage  # noqa: E402
from helpers import sglang as H  # noqa: E402
from helpers.sglang import (  # noqa: E402
    K,
    bare_layer,
    build_pair,
    forward,
    graph_config,
    paged_args,
)
from moepage.errors import ConfigError  # noqa: E402
from moepage.planning.sizing import checkpoint_size  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture(scope="module", autouse=True)
def sglang_process():
    H.setup_sglang()


# -- --paged-experts-num-resident auto ------------------------------------------------------------
def test_auto_sizing_reads_expert_bytes_from_safetensors_headers():
    from moepage.integrations import auto

    path = H.checkpoint("qwen3_moe", torch.bfloat16)
    ckpt = checkpoint_size(path)
    per_expert = 3 * H.INTER * H.HIDDEN * 2  # gate, up, down in bf16
    assert ckpt.num_layers == 2 and ckpt.expert_bytes == [per_expert, per_expert]
    total = sum(t.numel() * t.element_size() for _, t in H.checkpoint_weights(path))
    assert ckpt.dense_bytes == total - 2 * H.E * per_expert
    per_slot = per_expert * 2
    gpu = 10 * per_slot + ckpt.dense_bytes  # budget: fraction 1.0, no KV reserve -> 10 slots
    k, fig = auto.choose_resident(ckpt, H.E, H.TOP_K, gpu, 1.0, 0.0)
    assert k == H.E and fig["fits"] == 10  # clamped to E
    k, fig = auto.choose_resident(ckpt, H.E, H.TOP_K, 5 * per_slot + ckpt.dense_bytes, 1.0, 0.0)
    assert k == 5
    k, _ = auto.choose_resident(ckpt, H.E, H.TOP_K, 2 * (5 * per_slot + ckpt.dense_bytes), 0.5, 0.0)
    assert k == 5
    with pytest.raises(ConfigError, match="top_k=2 are needed"):
        auto.choose_resident(ckpt, H.E, H.TOP_K, per_slot + ckpt.dense_bytes, 1.0, 0.0)


def test_auto_resident_on_a_server(monkeypatch, caplog):
    """``auto`` through make_for_layer: K from the (faked) GPU size, logged; needs CUDA otherwise."""
    from moepage.integrations.sglang import method, sizing

    path = H.checkpoint("mixtral", torch.bfloat16)
    ckpt = checkpoint_size(path)
    per_slot = ckpt.slot_bytes
    gpu = int((4 * per_slot + ckpt.dense_bytes) / 0.75 / 0.5) + 1  # fraction 0.5, 25 % KV reserve -> K = 4

    def fake(num_experts, top_k, device, share):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": gpu})())
        monkeypatch.setattr(sizing, "_mem_fraction_static", lambda: 0.5)
        return real(num_experts, top_k, torch.device("cuda"), share)

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
    from moepage.integrations import session
    from moepage.integrations.sglang import sizing

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
    DEVICE_PLANNER_ENV = "MOEPAGE_DEVICE_PLANNER"

    monkeypatch.setenv(DEVICE_PLANNER_ENV, value)
    _, paged = build_pair("qwen3_moe", torch.bfloat16, k=4)
    assert (H.moe_layers(paged)[0].quant_method.pager.device_state is not None) is on


def test_backend_env_is_checked(monkeypatch):
    from moepage.integrations import session

    monkeypatch.setattr(session, "_LIFETIMES", {})
    monkeypatch.setenv("MOEPAGE_BACKEND", "gpu")
    with pytest.raises(ConfigError, match=r"MOEPAGE_BACKEND='gpu' is not one of cuda, torch, mock"):
        session.store_for(torch.device("cpu"))
    monkeypatch.setenv("MOEPAGE_BACKEND", "mock")
    assert session.store_for(torch.device("cpu")).name == "mock"


# -- plugin: entry point, flags, allow-list --------------------------------------------------------
def _plugin_env(tmp_path, allow: str | None) -> dict:
    """Environment for a fresh SGLang process that discovers the plugin through its entry point.
    Where the installed moepage does not declare it yet, a dist-info on PYTHONPATH declares the
    same entry point as pyproject.toml."""
    from moepage.integrations.sglang import ENTRY_POINT_GROUP, ENTRY_POINT_NAME

    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    paths = [str(Path(__file__).resolve().parents[3])]
    declared = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == ENTRY_POINT_NAME]
    if not declared:
        info = tmp_path / "moepage_sglang_entrypoint-0.0.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: moepage-sglang-entrypoint\nVersion: 0.0\n")
        (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n"
                                               f"{ENTRY_POINT_NAME} = moepage.integrations.sglang:register\n")
        paths.append(str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    if allow is not None:
        env["SGLANG_PLUGINS"] = allow
    return env


@pytest.mark.parametrize("policy,half_life", [(None, 1024), ("lru", 0), ("lfru:8", 8)])
def test_policy_setting_reaches_the_layers(monkeypatch, policy, half_life):
    """--paged-experts-policy (here through its record attribute) or MOEPAGE_POLICY picks the
    eviction policy of every layer, default moepage.DEFAULT_POLICY (lfu, H = 1024)."""
    from moepage.integrations.sglang.settings import FLAGS

    POLICY_ATTR = FLAGS["paged_experts_policy"].attr

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
        with pytest.raises(ConfigError, match=r"MOEPAGE_POLICY='mru' is not a policy \(unknown policy 'mru'"):
            bare_layer()


def test_flags_in_launch_server_help(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], env=_plugin_env(tmp_path, None),
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    text = " ".join(out.stdout.split())
    assert "--paged-experts-impl {moepage,sglang}" in text and "--paged-experts-policy" in text \
        and "--paged-experts-prefetch" in text
    assert "--enable-paged-experts" in text and "--paged-experts-num-resident {K,auto}" in text
    assert "That is SGLang's own implementation (--paged-experts-impl sglang). moepage's" in text


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

    monkeypatch.delenv("MOEPAGE_STATS_PATH", raising=False)
    assert [t for t, _, _ in plugin.hooks()] == [plugin.ADD_CLI_ARGS, plugin.FROM_CLI_ARGS, plugin.MAKE_FOR_LAYER,
                                                 plugin.POSTPROCESS, plugin.DUMMY_LOAD]
    assert _defines_method(*plugin.DUMMY_LOAD.rsplit(".", 2))  # the dummy loader's hook target exists too
    monkeypatch.setenv("MOEPAGE_STATS_PATH", "/tmp/x.json")
    assert (plugin.FLUSH_CACHE, dump.after_flush, "AFTER") in plugin.hooks()
    module, cls, method = plugin.FLUSH_CACHE.rsplit(".", 2)
    assert _defines_method(module, cls, method)  # the hook's target exists in sglang 0.5.23
    assert _defines_method("sglang.srt.entrypoints.engine", "Engine", "flush_cache")  # what callers call


def test_stats_dump_writes_every_paged_layer(tmp_path, monkeypatch):
    """The dump an Engine caller reads: each paged layer's E, K and counters, and their total."""
    import gc
    import json

    from moepage.integrations.sglang import dump

    path = tmp_path / "stats.json"
    monkeypatch.setenv("MOEPAGE_STATS_PATH", str(path))
    gc.collect()  # the models of earlier tests, and their paged layers, are gone
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
        want = layer.quant_method.pager.read_stats()
        assert (got["num_experts"], got["num_slots"]) == (H.E, K)
        assert (got["steps"], got["waves"], got["hits"], got["misses"]) == (1, 3, want.hits, want.misses)
        assert got["hits"] + got["misses"] == 7
    assert first["total"]["misses"] == moepage.integrations.sglang.stats(paged).total.misses
    dump.after_flush(None)
    assert json.loads(path.read_text())["seq"] == first["seq"] + 1


def test_pyproject_declares_the_entry_point():
    import tomllib

    from moepage.integrations.sglang import ENTRY_POINT_GROUP, ENTRY_POINT_NAME

    project = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]
    assert project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {}).get(ENTRY_POINT_NAME) \
        == "moepage.integrations.sglang:register"



def test_per_layer_split_from_a_file(monkeypatch, tmp_path):
    """--paged-experts-split / MOEPAGE_SPLIT: the i-th MoE layer keeps the file's K; with another
    total (the flag's K times the layers) the file's curves are re-split; a bad file is refused."""
    import gc
    import json

    from moepage.integrations import session
    from moepage.planning import budgets

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




# -- next-layer prefetch (--paged-experts-prefetch) -----------------------------------------------
@pytest.mark.parametrize("value,parsed", [(None, False), ("off", False), ("on", True), ("ON", True), ("3", 3), (2, 2)])
def test_prefetch_flag_values(value, parsed):
    from moepage.config import parse_prefetch as parse

    assert parse(value) == parsed


@pytest.mark.parametrize("bad", ["0", "-1", "yes", "2.5"])
def test_bad_prefetch_is_refused_at_startup(monkeypatch, bad):
    monkeypatch.setenv("MOEPAGE_SGLANG_PREFETCH", bad)
    with H.server_args(**paged_args()):
        graph_config()
        with pytest.raises(ConfigError, match=r"MOEPAGE_SGLANG_PREFETCH=.* is not a prefetch setting .*off, on"):
            bare_layer()


def test_prefetch_flag_reaches_the_layers_and_refuses_an_unlinked_forward(monkeypatch):
    """The record attribute (the CLI flag) sets it; a layer never linked by the post-load hook
    (here: built alone, never loaded through DefaultModelLoader) refuses to run rather than
    silently not prefetching."""
    from moepage.integrations.sglang.settings import FLAGS

    PREFETCH_ATTR = FLAGS["paged_experts_prefetch"].attr

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
    import moepage.capture as pager_module
    from moepage.prefetch import PrefetchLink

    monkeypatch.setenv("MOEPAGE_DEVICE_PLANNER", "1")
    monkeypatch.setenv("MOEPAGE_SGLANG_PREFETCH", value)
    k = 4
    ref, paged = build_pair(kind, torch.bfloat16, k=k)
    (r0, r1), (p0, p1) = H.moe_layers(ref), H.moe_layers(paged)
    s0, s1 = p0.quant_method, p1.quant_method
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
        monkeypatch.setattr(pager_module, "capturing", lambda: how == "captured")  # noqa: B023 reset within this iteration
        out0 = forward(p0, x, H.topk_output(ids0, i))
        before = s1.pager.read_stats()
        out1 = forward(p1, x, H.topk_output(ids1, i))
        after = s1.pager.read_stats()
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
    assert stats.total.prefetched > 0 and s0.pager.read_stats().prefetched == 0  # nothing prefetches into layer 0


def test_prefetch_without_a_router_is_refused_by_name(monkeypatch):
    from moepage.integrations.sglang.prefetch import link_model

    monkeypatch.setenv("MOEPAGE_SGLANG_PREFETCH", "on")
    _, paged = build_pair("qwen3_moe", torch.bfloat16)
    blocks = [m for m in paged.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    blocks[1].gate = torch.nn.Identity()
    name = H.moe_layers(paged)[1].quant_method.layer_key
    with pytest.raises(ConfigError, match=rf"layer {name} .*no router"):
        link_model(paged)
