"""CPU side of the engine benches' full-depth groups (``sglang_runs._full``, ``vllm_engine._full``): 48 layers of
Qwen3-30B-A3B shapes, K for about 16 GB of experts on the GPU, dummy weights from a folder of the config only (both
engines' configs read it), a block-FP8 checkpoint written without a bf16 copy, routing replayed in both engines
(vLLM's MoE runner too, in the vLLM test site), memory fractions that hold each run's weights on an H100, and
estimates of 48 layers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench.serving import route_replay
from bench.serving import sglang_ckpt as C
from bench.serving import sglang_engine as B
from bench.serving import sglang_runs as S
from bench.serving import vllm_engine as V
from helpers import vllm_site

GROUPS = ("full", "full_heat", "full_fp8")
ROOT = Path(__file__).resolve().parents[2]
TINY = replace(C.QWEN3_30B_FULL, layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, top_k=2, inter=128,
               vocab=64, context=256)  # whole 128 x 128 FP8 blocks
H100 = 80 * 10**9


def _full_runs() -> list:
    return [S.RUNS[n] for g in (*GROUPS, "full_profile") for n in S.GROUPS[g]]


def _gpu_expert_bytes(run) -> int:
    """Bytes of experts a run keeps on the GPU (all of them unpaged, less what it offloads; K a layer paged)."""
    spec, quant = S.MODELS[run.model], S.quantization(run.model)
    one = spec.stored_expert_bytes(quant)
    if run.impl != "unpaged":
        return spec.layers * run.k * one
    return spec.layers * spec.experts * one - run.offload_gb * 2**30


def test_the_full_groups_page_48_layers_with_k_for_16_gb_of_experts():
    runs = _full_runs()
    assert {S.MODELS[r.model] for r in runs} == {C.QWEN3_30B_FULL}
    spec = C.QWEN3_30B_FULL
    assert (spec.layers, spec.experts, spec.top_k, spec.hidden, spec.inter) == (48, 128, 8, 2048, 768)
    assert spec.expert_bytes == 3 * 2048 * 768 * 2
    for run in runs:
        assert run.reference in S.RUNS and S.RUNS[run.reference].impl == "unpaged", run.name
        if run.impl == "unpaged" and not run.offload_gb:
            continue
        one = spec.layers * spec.stored_expert_bytes(S.quantization(run.model))  # one slot over every layer
        held = _gpu_expert_bytes(run)
        assert abs(held - S.FULL_EXPERT_GPU_BYTES) < 0.05 * S.FULL_EXPERT_GPU_BYTES, run.name  # about 16 GB
        if run.impl != "unpaged":
            assert held <= S.FULL_EXPERT_GPU_BYTES < held + one, run.name  # the largest K within it
    ks = {r.model: r.k for r in runs if r.impl != "unpaged"}
    assert ks == {"full": 35, "full_heat": 35, "full_fp8": 70}
    assert {r.impl for r in runs if r.model == "full_fp8"} == {"unpaged", "moepage", "builtin"}
    assert not [r for r in runs if r.impl == "builtin" and r.model in S.DUMMY]  # SGLang's built-in refuses dummy
    for group in GROUPS:  # each group has its alternative at equal GPU memory
        assert any(S.RUNS[n].offload_gb for n in S.GROUPS[group]), group
    assert [r.phases for r in runs if r.group == "full_profile"] == [("profile",)] * 2
    assert all(r.phases == ("tput",) and r.new_tokens == S.FULL_NEW_TOKENS for r in runs if r.group in GROUPS)


def test_the_mem_fractions_hold_each_runs_weights_on_an_h100():
    """Every run's experts and attention fit its fraction of an 80 GB card with room for the KV cache; unpaged bf16
    (58 GB of experts) needs a high one."""
    spec = C.QWEN3_30B_FULL
    attention = spec.layers * 2 * spec.hidden * (2 * spec.heads + 2 * spec.kv_heads) * spec.head_dim
    for run in _full_runs():
        weights = _gpu_expert_bytes(run) + attention
        assert weights + 4 * 10**9 < run.mem * H100, (run.name, weights / 1e9, run.mem)
    assert S.RUNS["full-unpaged"].mem == 0.85 and 0.7 * H100 < spec.experts_bytes + attention


def test_estimates_and_timeouts_reflect_48_layers():
    """A start of 48 layers takes longer than one of 8 (their graphs captured, six times the weights); each run's
    timeout holds its estimate."""
    deep = S.RUNS["deep-unpaged"]
    for run in _full_runs():
        assert run.estimate >= deep.estimate + 300 and run.timeout >= run.estimate, run.name
    for name in (n for g in GROUPS for n in V.GROUPS[g]):
        run = V.RUNS[name]
        assert run.estimate >= V.RUNS["deep-unpaged"].estimate + 200 and run.timeout >= run.estimate, name


def test_dummy_runs_ask_for_dummy_weights_and_every_full_run_replays_its_routing(tmp_path, monkeypatch):
    monkeypatch.setenv(route_replay.ROUTE_ENV, "/elsewhere")  # a parent's table reaches no run that did not ask
    for run in _full_runs():
        kw = B.engine_kwargs(run, "/m")
        assert kw.get("load_format") == ("dummy" if run.model in S.DUMMY else None), run.name
        env = B.child_env(run, tmp_path)
        assert env[route_replay.ROUTE_ENV] == str(S.route_table(run, tmp_path)), run.name
        assert S.ROUTED[run.model][1] == ("qwen3-heat" if run.model == "full_heat" else "uniform")
    assert B.engine_kwargs(S.RUNS["full_fp8-unpaged"], "/m").get("fp8_gemm_runner_backend") == "triton"
    assert "load_format" not in B.engine_kwargs(S.RUNS["deep-unpaged"], "/m")
    assert route_replay.ROUTE_ENV not in B.child_env(S.RUNS["deep-unpaged"], tmp_path)
    S.write_routes(_full_runs(), tmp_path)
    for model in ("full", "full_heat", "full_fp8"):
        table = torch.load(tmp_path / "routes" / f"{model}.pt")
        assert table.shape[::2] == (48, 8) and int(table.max()) == 127, model
    uniform, heat = (torch.load(tmp_path / "routes" / f"{m}.pt") for m in ("full", "full_heat"))
    top = [torch.bincount(t[0].flatten(), minlength=128).max() for t in (uniform, heat)]
    assert top[1] > 2 * top[0]  # the replayed Qwen3-30B routing has hot experts; the uniform one none


def test_vllm_runs_mirror_sglangs_but_the_built_in(tmp_path):
    runs = [V.RUNS[n] for g in GROUPS for n in V.GROUPS[g]]
    assert [r.name for r in runs] == [r.name for r in _full_runs() if r.group in GROUPS and r.impl != "builtin"]
    for run in runs:
        twin = S.RUNS[run.name]
        assert (run.model, run.impl, run.k, run.mem, run.offload_gb, run.new_tokens) == (
            twin.model, twin.impl, twin.k, twin.mem, float(twin.offload_gb), twin.new_tokens)
        assert run.reference in V.RUNS and V.RUNS[run.reference].impl == "unpaged"
        kw = V.llm_kwargs(run, "/m")
        assert kw.get("load_format") == ("dummy" if run.model in S.DUMMY else None)
        assert kw.get("cpu_offload_gb", 0) == run.offload_gb
        env = V.child_env(run, tmp_path)
        assert env[route_replay.ROUTE_ENV] == str(S.route_table(run, tmp_path)) and env["VLLM_PLUGINS"] == "moepage"
    assert V.checkpoint_of("full_heat") == "full" and route_replay.ROUTE_ENV not in V.child_env(V.RUNS["qwen-unpaged"],
                                                                                                 tmp_path)


# -- checkpoints: the config alone, and block FP8 with no bf16 copy --------------------------------------------------
def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


@pytest.mark.parametrize("bench", ["sglang", "vllm"])
def test_full_checkpoints_are_a_config_and_fp8_written_alone(bench, tmp_path, monkeypatch):
    """What the full runs load: the dummy models' folder holds ``config.json`` alone; the FP8 one is the same weights
    as a twin quantized beside the bf16 checkpoint, with no bf16 copy written; a second call keeps both."""
    for module in (S, V, B):
        monkeypatch.setattr(module, "MODELS", {**module.MODELS, **{m: TINY for m in (*GROUPS, "full_profile")}})
    runs = [B.RUNS[n] for g in GROUPS for n in B.GROUPS[g]] if bench == "sglang" else \
        [V.RUNS[n] for g in GROUPS for n in V.GROUPS[g]]
    write = B.write_checkpoints if bench == "sglang" else V.write_checkpoints
    write(runs, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["full", "full_fp8"]
    assert sorted(p.name for p in (tmp_path / "ckpt" / "full").iterdir()) == ["config.json", C.MARKER]
    assert json.loads((tmp_path / "ckpt" / "full" / "config.json").read_text())["num_hidden_layers"] == TINY.layers
    assert C.is_complete(tmp_path / "ckpt" / "full", TINY, dummy=True) and not C.is_complete(tmp_path / "ckpt" / "full",
                                                                                              TINY)
    direct = _read(tmp_path / "ckpt" / "full_fp8")
    experts = [n for n in direct if ".experts." in n and n.endswith("proj.weight")]
    assert experts and all(direct[n].dtype == torch.float8_e4m3fn for n in experts)
    C.write_checkpoints(TINY, tmp_path / "bf16", {tmp_path / "twin": S.DIRECT["full_fp8"]}, threads=2)
    twin = _read(tmp_path / "twin")
    assert direct.keys() == twin.keys() and all(torch.equal(direct[n].view(torch.uint8), twin[n].view(torch.uint8))
                                                for n in twin)
    when = {p: p.stat().st_mtime_ns for p in (tmp_path / "ckpt").rglob("*")}
    write(runs, tmp_path / "ckpt")
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "ckpt").rglob("*")} == when  # complete: kept


def test_sglang_reads_the_config_only_folder_as_the_dummy_runs_ask(tmp_path):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    C.write_config(C.QWEN3_30B_FULL, tmp_path / "full")
    run = S.RUNS["full-moepage-k35"]
    args = ServerArgs(**B.engine_kwargs(run, str(tmp_path / "full")))
    config = ModelConfig.from_server_args(args)
    assert args.load_format == "dummy" and config.num_hidden_layers == 48 and config.hf_config.num_experts == 128


def _vllm(code: str, env: dict | None = None, *args: str) -> str:
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code, *args], capture_output=True, text=True,
                          env=env or vllm_site.environment(), cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_vllm_makes_the_engine_config_of_the_dummy_runs_from_the_config_only_folder(tmp_path):
    """vLLM's own ``EngineArgs`` with a full run's arguments over the config-only folder: the engine config is made
    (moepage's launch checks pass: dummy weights are served), 48 layers, dummy load format."""
    C.write_config(C.QWEN3_30B_FULL, tmp_path / "full")
    kw = {name: V.llm_kwargs(V.RUNS[name], str(tmp_path / "full")) for name in ("full-unpaged", "full-moepage-k35")}
    code = ("import json, sys; from vllm.engine.arg_utils import EngineArgs\n"
            "for kw in json.loads(sys.argv[1]).values():\n"
            "    c = EngineArgs(**{k: v for k, v in kw.items() if k not in ('attention_backend', 'moe_backend')})"
            ".create_engine_config()\n"
            "print(json.dumps([c.model_config.hf_config.num_hidden_layers, c.load_config.load_format,"
            " c.additional_config]))")
    layers, load_format, extra = json.loads(_vllm(code, None, json.dumps(kw)))
    assert (layers, load_format, extra) == (48, "dummy", {"moepage": {"num_resident": 35}})


VLLM_ROUTES = """
import json, sys, tempfile, torch
sys.path.insert(0, "tests/integrations/vllm")
import vllm_double, vllm_layers
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
vllm_double.install()
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tempfile.mkstemp()[1]}")
    initialize_model_parallel(1, 1)
E, H, I = 128, 64, 32
gen = torch.Generator().manual_seed(0)
ckpt = {f"{e}.{n}.weight": torch.randn(s, generator=gen) * 0.1 for e in range(E)
        for n, s in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))}
seen = []
for layer in (0, 2):  # one forward: layer 0 advances the replay's step
    runner, config = vllm_layers.build(None, ckpt, device="cpu", prefix=f"model.layers.{layer}.mlp.experts",
                                       num_experts=E, top_k=8, hidden_size=H, intermediate_size=I,
                                       params_dtype=torch.float32)
    forward = runner.routed_experts.forward_modular
    def record(*args, forward=forward, **kwargs):
        seen.append(kwargs["topk_ids"].tolist())
        return forward(*args, **kwargs)
    runner.routed_experts.forward_modular = record
    vllm_layers.step(runner, config, torch.randn(5, H, generator=gen), torch.randn(5, E, generator=gen))
print(json.dumps(seen))
"""


def test_an_engine_process_routes_through_vllms_runner_with_the_tables_ids(tmp_path):
    """vLLM's own MoE runner, router and (stand-in) kernel: with the replay's environment each layer's experts get the
    table's ids for that layer, rows a step apart as in SGLang; without it, vLLM's own routing."""
    path = route_replay.write_table("uniform", 4, 128, 8, tmp_path / "t.pt")
    table = torch.load(path)
    env = {k: v for k, v in vllm_site.environment().items() if k != route_replay.ROUTE_ENV}
    own = json.loads(_vllm(VLLM_ROUTES, env))
    first, third = json.loads(_vllm(VLLM_ROUTES, route_replay.child_env(path, env)))
    spread = table.shape[1] // route_replay.ROW_SPREAD
    assert first == table[0, [r * spread + 1 for r in range(5)]].tolist()
    assert third == table[2, [r * spread + 1 for r in range(5)]].tolist()
    assert own[0] != first and all(len(set(row)) == 8 for row in own[0])
    assert os.pathsep.join([str(route_replay.SITE), str(ROOT)]) in route_replay.child_env(path, env)["PYTHONPATH"]
