"""CPU side of ``bench/serving/vllm_engine.py`` (the vLLM engine check and throughput, run on an H200): the run
matrix, the ``LLM`` arguments against vLLM 0.33.0's own ``EngineArgs`` (in the vLLM test site), a child run through
every phase on a stand-in ``vllm`` module, and the report's equal counts and ratios."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from bench.serving import sglang_runs as S
from bench.serving import vllm_engine as V
from helpers import vllm_site


def test_matrix_pairs_every_paged_run_with_its_unpaged_reference_and_the_offload():
    assert len(V.RUNS) == len(V._matrix())
    for run in V.RUNS.values():
        assert run.reference in V.RUNS and V.RUNS[run.reference].impl == "unpaged", run.name
    deep = [V.RUNS[n] for n in V.GROUPS["deep"]]
    assert V.MODELS["deep"].layers >= 8 and {r.impl for r in deep} == {"unpaged", "moepage"}
    offload = next(r for r in deep if r.offload_gb)
    assert offload.offload_gb == S.equal_memory_offload_gb(V.MODELS["deep"], V.MODELS["deep"].experts // 4)
    assert "tput" in offload.phases and [r.name for r in V.select("deep")] == V.GROUPS["deep"]
    with pytest.raises(SystemExit, match="unknown run or group 'nope'"):
        V.select("check,nope")


def test_llm_arguments_are_vllms_engine_args():
    kws = {name: V.llm_kwargs(run, "/m") for name, run in V.RUNS.items()}
    assert kws["qwen-moepage-k32"]["additional_config"] == {"moepage": {"num_resident": 32}}
    assert "additional_config" not in kws["qwen-unpaged"] and kws["qwen-unpaged-eager"]["enforce_eager"]
    assert kws["deep-offload7g"]["cpu_offload_gb"] == 7.0 and "cpu_offload_gb" not in kws["deep-unpaged"]
    names = sorted({k for kw in kws.values() for k in kw})
    code = ("import dataclasses, json, sys; from vllm.engine.arg_utils import EngineArgs; "
            "fields = {f.name for f in dataclasses.fields(EngineArgs)}; "
            "print(json.dumps(sorted(set(json.loads(sys.argv[1])) - fields)))")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code, json.dumps(names)], capture_output=True,
                          text=True, env=vllm_site.environment(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


class FakeLLM:
    """``vllm.LLM`` enough for ``run_child``: echoes prompts, counts 3 misses a request when paged."""

    made: list = []

    def __init__(self, **kw):
        self.kw, self.requests = kw, 0
        FakeLLM.made.append(self)

    def generate(self, prompts, params, use_tqdm=True):
        self.requests += len(prompts)
        out = types.SimpleNamespace
        return [out(outputs=[out(token_ids=list(p["prompt_token_ids"][:1]) * s.max_tokens)])
                for p, s in zip(prompts, params)]

    def apply_model(self, func):
        if "additional_config" not in self.kw:
            return [{}]
        return [{"layer.0": {"num_experts": 128, "num_slots": 32, "misses": 3 * self.requests}}]


def _fake_vllm(monkeypatch):
    params = lambda **kw: types.SimpleNamespace(**kw)  # noqa: E731
    vllm = types.SimpleNamespace(LLM=FakeLLM, SamplingParams=params)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", types.SimpleNamespace(TokensPrompt=dict))


def test_a_child_runs_every_phase_and_the_report_compares(tmp_path, monkeypatch):
    _fake_vllm(monkeypatch)
    for name in ("deep-unpaged", "deep-moepage-k32", "deep-offload7g"):
        V.run_child(V.RUNS[name], tmp_path, tmp_path / "ckpt")
    paged = json.loads((tmp_path / "deep-moepage-k32.json").read_text())
    assert paged["status"] == "ok" and paged["layers"] == {"layer.0": {"num_experts": 128, "num_slots": 32}}
    tput = paged["phases"]["tput"]["batches"]
    assert set(tput) == {"1", "8", "32"} and tput["8"]["new_tokens"] == 8 * 64 and tput["8"]["misses"] == 3 * 8
    assert len(paged["phases"]["batch"]["outputs"]) == 16 == len(paged["phases"]["batch"]["outputs_b"])
    text = V.report(tmp_path)
    assert "| deep-moepage-k32 | ok | 32 |" in text and "16/16" in text
    assert (tmp_path / "REPORT.md").read_text() == text and "vs_offload" in text

    class Unpaged(FakeLLM):  # the plugin not active in the worker
        def apply_model(self, func):
            return [{}]

    monkeypatch.setattr(sys.modules["vllm"], "LLM", Unpaged)
    with pytest.raises(RuntimeError, match="moepage run, but 0 layers are paged by moepage in vLLM's worker"):
        V.run_child(V.RUNS["qwen-moepage-k32"], tmp_path, tmp_path / "ckpt")
    assert json.loads((tmp_path / "qwen-moepage-k32.json").read_text())["status"] == "failed"


def test_report_counts_equal_outputs_and_ratios(tmp_path):
    def result(run, outputs, decode_tok_s):
        spec = {**V.RUNS[run].__dict__, "phases": list(V.RUNS[run].phases)}
        phases = {"batch": {"outputs": outputs, "outputs_b": [[1, 2], [3, 4]]},
                  "tput": {"batches": {"8": {"decode_tok_s": decode_tok_s}}}}
        return dict(run=run, spec=spec, status="ok", phases=phases, load_s=50.0)

    rows = {"deep-unpaged": result("deep-unpaged", [[1, 2], [3, 4]], 400.0),
            "deep-moepage-k32": result("deep-moepage-k32", [[1, 2], [3, 5]], 200.0),
            "deep-offload7g": result("deep-offload7g", [[1, 2], [3, 4]], 50.0)}
    for name, r in rows.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    text = V.report(tmp_path)
    assert "| deep-moepage-k32 | ok | 32 | 50 | 1/2 | – | 1/2 |" in text  # batch, sequential, the batch twice
    assert "| deep-unpaged | ok | – | 50 | 2/2 | – | 2/2 |" in text
    assert "| deep-moepage-k32 | 8 | 200 | – | 0.5 | 4 |" in text
    assert "| deep-offload7g | 8 | 50 | – | 0.125 | – |" in text


def test_a_quantized_model_is_written_beside_its_bf16_weights(tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr(V, "unavailable", lambda: None)
    monkeypatch.setattr(V.ckpt, "write_checkpoints", lambda *args: written.append(args) or {})
    monkeypatch.setattr(V.matrix, "run_all", lambda *a: None)
    monkeypatch.setattr(V, "report", lambda out: "")
    assert V.main(["--out", str(tmp_path), "--ckpt-dir", str(tmp_path / "c"), "--only", "qwen_fp8-moepage-k32"]) == 0
    twin = {tmp_path / "c" / "qwen_fp8": V.ckpt_quant.FP8_BLOCK}
    assert written == [(V.MODELS["qwen"], tmp_path / "c" / "qwen", twin)]
    assert V.llm_kwargs(V.RUNS["qwen_fp8-moepage-k32"], "/m")["moe_backend"] == "triton"  # the kernel paging serves


def test_the_engine_takes_every_prompt_of_a_batch_before_its_first_step(tmp_path, monkeypatch):
    """The engine core in the LLM's process (a core in its own starts on the prompts that have arrived), read where
    vLLM reads it; the plugin and apply_model's serialisation as before."""
    seen = {}
    monkeypatch.setattr(V, "unavailable", lambda: None)
    monkeypatch.setattr(V.ckpt, "write_checkpoints", lambda spec, path, twins: {})
    monkeypatch.setattr(V.matrix, "run_all", lambda runs, out, budget, force, start: start(runs[0], 60))
    monkeypatch.setattr(V.matrix, "launch", lambda run, out, ckpt, limit, env, module: seen.update(env))
    assert V.main(["--out", str(tmp_path), "--only", "qwen-unpaged"]) == 0
    assert seen["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and seen["VLLM_PLUGINS"] == "moepage"
    code = "import vllm.envs as e; print(e.VLLM_ENABLE_V1_MULTIPROCESSING)"
    env = {**vllm_site.environment(), "VLLM_ENABLE_V1_MULTIPROCESSING": seen["VLLM_ENABLE_V1_MULTIPROCESSING"]}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "False", done.stderr[-2000:]


def test_main_lists_and_skips_without_a_gpu(tmp_path, capsys):
    assert V.main(["--list"]) == 0 and "deep: deep-unpaged" in capsys.readouterr().out
    assert V.main(["--out", str(tmp_path)]) == 0
    assert "SKIPPED: bench.serving.vllm_engine needs a CUDA GPU with vLLM" in capsys.readouterr().out


def test_lease_script_shows_vllm_the_plugin_without_installing(tmp_path):
    """bench/gpu_vllm_lease.sh gives vLLM's entry point lookup moepage's plugin from a dist-info made from
    pyproject.toml (gpu_sglang_lease.sh's), no pip on the GPU machine."""
    import os
    import shutil

    source, repo = Path(__file__).resolve().parents[2], tmp_path / "repo"
    shutil.copytree(source / "moepage", repo / "moepage", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "bench").mkdir()
    for script in ("gpu_sglang_lease.sh", "gpu_vllm_lease.sh"):
        shutil.copy(source / "bench" / script, repo / "bench")
    shutil.copy(source / "pyproject.toml", repo)
    (tmp_path / "env.sh").write_text("")  # stands in for /tmp/vllm/env.sh
    env = {**os.environ, "VLLM_ENV": str(tmp_path / "env.sh"), "MOEPAGE_EP_DIR": str(tmp_path / "ep"),
           "OUT": str(tmp_path / "out"), "PYTHONPATH": ""}
    out = subprocess.run(["bash", "bench/gpu_vllm_lease.sh", "entry-point"], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (info,) = (tmp_path / "ep").glob("moepage-*.dist-info")
    assert f"moepage.integrations.vllm:register (from {info})" in out.stdout
    usage = subprocess.run(["bash", "bench/gpu_vllm_lease.sh"], cwd=repo, capture_output=True, text=True)
    assert usage.returncode == 2 and "bench GROUPS" in usage.stdout and "set -euo" not in usage.stdout
