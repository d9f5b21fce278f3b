"""``bench.kernels.compress_bench`` on the CPU: its arguments, the SKIPPED line without CUDA, and
its ``--tiny`` smoke run (table a under the Triton interpreter: decoded slots checked bit for bit
against the raw gather's, JSON written)."""

from __future__ import annotations

import json

import pytest
import torch

from bench.kernels import compress_bench as cb
from moepage.kernels.planner import triton_available


def test_arguments() -> None:
    args = cb.parse([])
    assert args.counts == [64, 32, 8] and not args.tiny and args.json is None
    assert cb.parse(["--experts", "3,1"]).counts == [3, 1]
    with pytest.raises(SystemExit):
        cb.parse(["--experts", "65"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real one")
def test_skips_without_cuda(capsys) -> None:
    assert cb.main([]) is None
    assert "SKIPPED: bench.kernels.compress_bench needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_tiny_run_checks_and_writes_json(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "c.json"
    results = cb.main(["--tiny", "--experts", "8,3", "--json", str(out)])
    assert [r["experts"] for r in results["a_gather"]] == [8, 3]
    assert all(r["read_mb_coded"] < r["delivered_mb"] for r in results["a_gather"])
    assert 1.25 < results["d_host_bytes"][0]["ratio"] < 4 / 3
    assert json.loads(out.read_text())["a_gather"][1]["experts"] == 3
