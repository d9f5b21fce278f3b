"""CPU side of ``bench/serving/step_profile.py``: kernels sorted into planning, page-in, expert GEMMs and the rest,
read from torch-profiler traces as SGLang writes them, and the engine phase against a stand-in engine."""

from __future__ import annotations

import gzip
import json

import pytest

from bench.serving import step_profile as P


def _trace(path, kernels):
    events = [{"ph": "X", "cat": cat, "name": name, "dur": dur} for cat, name, dur in kernels]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 1000.0})  # host side: not GPU time
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


@pytest.mark.parametrize("name, label", [
    ("_plan_kernel", "planning"), ("_ranks_kernel", "planning"), ("_gather_kernel", "page-in"),
    ("_decode_kernel", "page-in"), ("Memcpy HtoD (Pinned -> Device)", "page-in"),
    ("fused_moe_kernel", "expert GEMMs"), ("moe_align_block_size_kernel", "expert GEMMs"),
    ("void moe_sum_kernel<...>", "expert GEMMs"), ("act_and_mul_kernel", "expert GEMMs"),
    ("_w8a8_block_fp8_matmul", "rest"), ("flash_fwd_kernel", "rest"), ("Memcpy DtoD", "rest"),
])
def test_each_kernel_goes_to_its_category(name, label):
    assert P.category(name) == label


def test_a_step_is_its_gpu_time_over_the_steps_by_category(tmp_path):
    _trace(tmp_path / "a-TP-0-decode.trace.json.gz", [
        ("kernel", "_plan_kernel", 10.0), ("kernel", "_gather_kernel", 30.0), ("gpu_memcpy", "Memcpy HtoD", 20.0),
        ("kernel", "fused_moe_kernel", 100.0), ("kernel", "attention", 40.0), ("kernel", "rmsnorm", 10.0)])
    got = P.summarize([tmp_path / "a-TP-0-decode.trace.json.gz"], steps=2)
    assert got["step_us"] == pytest.approx(105.0)
    assert got["us"] == pytest.approx({"planning": 5.0, "page-in": 25.0, "expert GEMMs": 50.0, "rest": 25.0})
    assert sum(got["share"].values()) == pytest.approx(1.0) and got["share"]["page-in"] == pytest.approx(50 / 210)
    assert got["rest_top"] == [("attention", 20.0), ("rmsnorm", 5.0)]


class Engine:
    """``sglang.Engine`` enough for the phase: a profile armed by start_profile is written by the next generate."""

    def __init__(self, write=True):
        self.armed, self.write, self.calls = None, write, []

    def start_profile(self, **kw):
        self.armed = kw

    def generate(self, input_ids, sampling_params):
        self.calls.append((len(input_ids), sampling_params["max_new_tokens"]))
        if self.armed and self.write:
            _trace(f"{self.armed['output_dir']}/x-TP-0-decode.trace.json.gz",
                   [("kernel", "_gather_kernel", 8.0 * len(input_ids)), ("kernel", "fused_moe_kernel", 24.0)])
        self.armed = None


def test_the_phase_profiles_decode_steps_at_each_batch_and_says_when_there_is_no_trace(tmp_path):
    eng = Engine()
    got = P.profile_decode(eng, {1: [[1, 2]], 8: [[1]] * 8}, 16, tmp_path)["batches"]
    assert eng.calls == [(1, 16), (1, 16), (8, 16), (8, 16)]  # a warm-up, then the profiled run
    assert got["1"]["step_us"] == pytest.approx(32 / P.STEPS) and got["8"]["us"]["page-in"] == pytest.approx(8.0)
    rows = P.rows({"deep-moepage-k32-profile": {"phases": {"profile": {"batches": got}}}})
    assert [r["batch"] for r in rows] == [1, 8] and rows[1]["page-in %"] == pytest.approx(100 * 64 / 88)
    none = P.profile_decode(Engine(write=False), {1: [[1]]}, 16, tmp_path / "none", wait_s=0.1)["batches"]["1"]
    assert "no trace in" in none["error"]
    assert P.rows({"r": {"phases": {"profile": {"batches": {"1": none}}}}})[0]["step_us"] is None

    class Refusing(Engine):
        def start_profile(self, **kw):
            raise RuntimeError("profiling is off")

    refused = P.profile_decode(Refusing(), {1: [[1]]}, 16, tmp_path / "off")["batches"]["1"]
    assert refused == {"error": "start_profile: RuntimeError('profiling is off')"}


def test_the_profile_request_is_sglangs_own():
    pytest.importorskip("sglang")
    from sglang.srt.managers.io_struct import ProfileReq, ProfileReqType

    req = ProfileReq(req_type=ProfileReqType.START_PROFILE, **P.request("/tmp/p"))
    assert req.num_steps == P.STEPS and req.profile_stages == ["decode"] and req.activities == ["GPU"]
