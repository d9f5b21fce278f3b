"""The split bench's CPU smoke run (``bench.models.split_decode --smoke``): every run kind of every routing and rows
(host and disk tier) is timed, page-in only equals unpaged, the forced share computes experts on the CPU, and the
report holds a verdict per group."""

from __future__ import annotations

import json

import torch

from bench.models import split_decode


def test_split_decode_cpu_smoke(tmp_path):
    threads = torch.get_num_threads()
    try:
        rc = split_decode.main(["--smoke", "--out", str(tmp_path), "--batch", "1,2", "--steps", "2",
                                "--warmup", "1"])
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "split_decode.json").read_text())
    assert rc == 0 and (tmp_path / "split_decode.md").is_file()
    rows = data["rows"]
    runs = {(r["routing"], r["rows"], r["run"]) for r in rows}
    for routing in ("uniform", "calibrated"):
        for tier in ("host", "disk"):
            assert {(routing, tier, run) for run in ("page-in only", "split auto", "split 0.5")} <= runs
    assert all(r["equal_unpaged"] for r in rows if r["run"] == "page-in only")
    assert all(r["cpu_step"] > 0 for r in rows if r["run"] == "split 0.5")  # the forced share splits
    assert all(r["cpu_step"] == 0 for r in rows if r["run"] == "page-in only")
    assert any(r["run"].startswith("bound") for r in rows)
    assert len([v for v in data["verdicts"] if "stops paying" in v or "pays at every" in v]) == 4
