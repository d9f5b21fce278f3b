"""CPU tests of the benchmark scripts' pure-Python parts (bench/model_decode.py,
bench/sglang_kernels.py): the router hook's id schedule, the miss prediction, the bound, the goal
verdicts, table formatting, and SGLang's decode step on a torch reference of its kernels."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import model_decode as md  # noqa: E402
import sglang_kernels as sk  # noqa: E402
from moepage.traces import shared_traces_dir  # noqa: E402


def test_id_schedule_offsets_layers_and_wrap():
    seq = np.arange(10 * 3 * 2).reshape(10, 3, 2)  # [tokens, layers, top_k]
    out = md.id_schedule(seq, steps=12, batch=2, layers=2)
    assert out.shape == (12, 2, 2, 2)  # [steps, layers, batch, top_k]
    for t in range(12):
        for b in range(2):
            assert (out[t, :, b] == seq[(t + b * 5) % 10, :2]).all()  # offset b * len / B, cyclic
    assert (md.id_schedule(seq, 3, 1, 3)[:, :, 0] == seq[:3]).all()


@pytest.mark.skipif(not (shared_traces_dir() / "granite_1b_a400m_onnxgenai").is_dir(), reason="shared traces absent")
def test_granite_sequence_is_the_real_decode_trace():
    seq = md.granite_sequence()
    assert seq.shape == (192, 24, 8)  # 3 prompts x 64 decode steps, 24 layers, top-8
    assert seq.min() >= 0 and seq.max() < 32
    assert all(len(set(row)) == 8 for row in seq.reshape(-1, 8).tolist())  # distinct per token


def test_predicted_misses_follow_the_host_planner():
    sched = np.array([[0, 1], [2, 3], [0, 2]])[:, None, None, :]  # 3 steps, 1 layer, 1 token, top-2
    # Slots start with experts 0, 1: step 0 hits, step 1 pages 2 and 3, step 2 pages 0 only.
    assert md.predicted_misses(sched, 4, 2, 0, 3) == 1.0
    assert md.predicted_misses(sched, 4, 2, 1, 3) == 1.5
    assert md.predicted_misses(sched, 4, 4, 0, 3) == 0.0  # K = E: everything resident
    wide = np.array([[0, 1, 2, 3]])[:, None, None, :]  # more experts than slots: two waves
    assert md.predicted_misses(wide, 4, 2, 0, 1) == 2.0


def test_bound_adds_missed_bytes_at_the_link_rate():
    assert md.bound_ms(10.0, 2 * 55e6, 55.0) == pytest.approx(12.0)
    assert md.bound_ms(3.0, 0.0, 40.0) == 3.0


def _row(run, ms, kfrac=None, mode="graph", batch=1, **kw):
    return dict(model="m", batch=batch, run=run, k_over_e=kfrac, k=None if kfrac is None else int(kfrac * 8),
                mode=mode, ms=ms, **kw)


def test_goals_say_met_or_not_with_numbers():
    rows = [
        _row("unpaged", 10.0),
        _row("moepage", 10.4, 1.0), _row("bound", 10.0, 1.0, mode="unpaged + missed"), _row("sglang", 12.0, 1.0),
        _row("moepage", 30.0, 0.25), _row("bound", 25.0, 0.25, mode="unpaged + missed"),
        _row("sglang", None, 0.25, mode="n/a: SGLang decides <= K"),
        _row("moepage", 50.0, 0.5, mode="eager: capture raised ConfigError: too many"),
    ]
    text = "\n".join(md.goals(rows))
    assert "K/E=1.00: >= 0.95x unpaged tokens/s: met (0.962x)" in text
    assert "K/E=1.00: <= 1.10x the bound's step time: met (1.040x)" in text
    assert "K/E=1.00: ahead of SGLang's mechanism: met (1.154x its tokens/s)" in text
    assert "K/E=0.25: <= 1.10x the bound's step time: NOT met (1.200x)" in text
    assert "K/E=0.25: vs SGLang's mechanism: no figure (n/a: SGLang decides <= K)" in text
    assert "K/E=0.50: not met (not captured: eager: capture raised ConfigError: too many)" in text
    assert "0.95x unpaged" not in text.split("K/E=0.25")[1]  # that goal is at K/E = 1.0 only


def test_markdown_formats_missing_and_failed_cells():
    rows = [_row("unpaged", 10.0, tok_s=100.0, vs_unpaged=1.0, equal=None),
            _row("moepage", 12.5, 0.5, misses_step=3.25, host_misses_step=3.0, vs_bound=1.05, equal=False, first_bad=3),
            _row("sglang", None, 0.5, mode="sglang is not installed here")]
    text = md.markdown(rows)
    lines = text.splitlines()
    assert lines[0].startswith("| model | B | run | K/E | K | mode | ms/step |")
    assert len(lines) == 2 + len(rows)
    assert "| 0.50 | 4 | graph | 12.500 |" in lines[3]
    assert "3.2 / 3.0" in lines[3] and "NO (step 3)" in lines[3]
    assert "| sglang is not installed here | - |" in lines[4]


def test_sglang_step_on_the_reference_kernels_pages_exactly():
    e, k = 6, 3
    hosts = [torch.arange(e * 4, dtype=torch.float32).reshape(e, 4), torch.arange(e, dtype=torch.int16).reshape(e, 1) * 7]
    slots = [torch.zeros(k, *h.shape[1:], dtype=h.dtype) for h in hosts]
    pager = sk.SglangPager(sk.torch_reference_ops(), hosts, slots, e)
    pager.reset()  # slots 0..2 hold experts 0..2, all last used at step 0
    for ids in ([[4, 0]], [[5, 4]], [[1, 2]]):
        ids = torch.tensor(ids)
        slot_ids = pager.step(ids)
        for s_t, h_t in zip(slots, hosts):
            assert torch.equal(s_t[slot_ids.flatten()], h_t[ids.flatten()])  # every routed expert resident
    # 4 takes slot 1 (oldest unused, lowest), 5 takes slot 2 (older than 0's), then 1 takes slot 0
    # (0 was used at step 1) and 2 takes slot 1 (a tie with slot 2 at step 2: lowest slot).
    assert pager.slot_expert.tolist() == [1, 2, 5] and pager.step_no.item() == 3
    assert pager.expert_slot[0].item() == pager.expert_slot[4].item() == -1


def test_variant_names_are_distinct():
    assert sk.VARIANTS[0].name == "item grid, 4 KiB x 8, 4 warps"
    assert any(".cg" in v.name for v in sk.VARIANTS)
    assert len({v.name for v in sk.VARIANTS}) == len(sk.VARIANTS)
