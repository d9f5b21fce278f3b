"""CPU side of ``bench/serving/route_replay.py`` (the engine bench's trace routing): the table is the trace's steps
per layer, rows walk it one step a forward with padded rows kept out, and an engine process started with the
replay's environment routes through SGLang's own ``select_experts`` with the table's ids (without it, its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.serving import route_replay as R


def test_the_table_is_the_traces_steps_for_each_model_layer(tmp_path):
    from bench.analysis.trace_replay import make_trace

    path = R.write_table("qwen3-heat", 8, 128, 8, tmp_path / "t.pt")
    table, trace = torch.load(path), make_trace(R.TRACES["qwen3-heat"])
    assert table.shape == (8, trace.num_steps, 8) and table.dtype == torch.int32
    assert [tuple(table[3, 7].tolist())] == [trace.layers[3 * len(trace.layers) // 8][7]]
    assert all(len(set(row)) == 8 for row in table[:, :50].reshape(-1, 8).tolist())
    with pytest.raises(ValueError, match="routes E=128 top-8, the model E=64 top-8"):
        R.write_table("qwen3-heat", 8, 64, 8, tmp_path / "u.pt")


def test_rows_walk_the_table_a_step_per_forward_and_padding_stays_out():
    steps = 256
    table = torch.arange(2 * steps * 2, dtype=torch.int32).view(2, steps, 2)
    replay, spread = R.Replay(table), steps // R.ROW_SPREAD
    for forward in (1, 2, 3):
        for layer in (0, 1):
            ids = torch.zeros(5, 2, dtype=torch.long)
            replay.route(layer, ids, torch.tensor(4))
            want = table[layer, [(r * spread + forward) % steps for r in range(4)]].long()
            assert torch.equal(ids[:4], want) and ids[4].tolist() == [-1, -1]


CALL = """
import json, torch
from sglang.srt.layers.moe import topk as T
cfg = T.TopKConfig(top_k=8, renormalize=True, torch_native=True)
gen = torch.Generator().manual_seed(0)
x, logits = torch.randn(5, 16, generator=gen), torch.randn(5, 128, generator=gen)
first = T.select_experts(hidden_states=x, router_logits=logits, topk_config=cfg, layer_id=0)
third = T.select_experts(hidden_states=x, router_logits=logits, topk_config=cfg, layer_id=2,
                         num_token_non_padded=torch.tensor(3))
print(json.dumps([first.topk_ids.tolist(), third.topk_ids.tolist()]))
"""


def _engine_process(env: dict, tmp_path) -> list:
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", CALL], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_engine_process_routes_through_sglang_with_the_tables_ids(tmp_path):
    pytest.importorskip("sglang.srt.layers.moe.topk")
    path = R.write_table("qwen3-heat", 8, 128, 8, tmp_path / "t.pt")
    table = torch.load(path)
    env = {k: v for k, v in os.environ.items() if k != R.ROUTE_ENV}
    own = _engine_process(env, tmp_path)
    first, third = _engine_process(R.child_env(path, env), tmp_path)
    spread = table.shape[1] // R.ROW_SPREAD
    assert first == table[0, [r * spread + 1 for r in range(5)]].tolist()
    assert third[:3] == table[2, [r * spread + 1 for r in range(3)]].tolist() and third[3:] == [[-1] * 8] * 2
    assert own[0] != first and own[1][3] == third[3]  # SGLang's own routing without it (padding: -1 either way)
