"""``LayerWaves`` with the Marlin contract against a recording runner (no kernels): every wave runs the whole batch on
the slot table, as SGLang's executors run one wave, and the waves' entries merge into one buffer. Whether that stays
within Marlin's noise is measured on a GPU (tests/gpu/test_sglang_formats_gpu.py)."""

from __future__ import annotations

import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)
import torch

from moepage.integrations.sglang import compat  # noqa: E402
from moepage.integrations.sglang.contracts import MARLIN_ON_SLOTS, LayerWaves  # noqa: E402
from moepage.step import StepWave  # noqa: E402

T, TOP_K, HIDDEN = 5, 2, 4


class RecordingRunner:
    """A runner method whose per-entry output is its token's hidden state times (slot + 1) times its weight."""

    def __init__(self):
        self.calls = []

    def apply(self, layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        topk = dispatch_output.topk_output
        self.calls.append(topk)
        factor = (topk.topk_ids + 1).to(torch.float32) * topk.topk_weights
        out = dispatch_output.hidden_states.unsqueeze(1) * factor.unsqueeze(-1)
        return StandardCombineInput(hidden_states=out)


def dispatch(seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, HIDDEN, generator=g)
    weights = torch.rand(T, TOP_K, generator=g)
    ids = torch.randint(0, 8, (T, TOP_K), generator=g)
    return compat.standard_dispatch(hidden, weights, ids, torch.randn(T, 8, generator=g))


def expected(d, slots):
    """Each served entry's output, zero elsewhere."""
    factor = (slots + 1).to(torch.float32) * d.topk_output.topk_weights
    out = d.hidden_states.unsqueeze(1) * factor.unsqueeze(-1)
    return torch.where((slots >= 0).unsqueeze(-1), out, torch.zeros_like(out))


def on_the_slot_table(topk, slots) -> None:
    """The runner saw the unpaged batch shape: the wave's slots, the other entries on slot 0 at weight 0."""
    assert topk.topk_ids.shape == (T, TOP_K)  # not compacted
    assert torch.equal(topk.topk_ids, slots.clamp(min=0).to(torch.int32))
    assert torch.equal(topk.topk_weights[slots < 0], torch.zeros(int((slots < 0).sum())))


def test_a_marlin_step_of_one_wave_runs_the_whole_batch_on_the_slot_table():
    d, runner = dispatch(0), RecordingRunner()
    slots = torch.tensor([[0, 3], [1, 2], [-1, 3], [2, 0], [1, -1]])  # -1: padding entries
    waves = LayerWaves(MARLIN_ON_SLOTS, runner, None, d, 1.0)
    waves.run(StepWave(slots, 0, 1))
    (topk,) = runner.calls
    on_the_slot_table(topk, slots)
    assert torch.equal(waves.merged, expected(d, slots))


def test_a_marlin_step_of_many_waves_runs_each_on_the_slot_table_and_merges_them():
    d, runner = dispatch(1), RecordingRunner()
    first = torch.tensor([[0, -1], [1, 2], [-1, -1], [2, 0], [1, -1]])
    second = torch.tensor([[-1, 1], [-1, -1], [0, 2], [-1, -1], [-1, 0]])
    third = torch.full((T, TOP_K), -1)  # an empty wave (a captured step's fixed count) changes nothing
    waves = LayerWaves(MARLIN_ON_SLOTS, runner, None, d, 1.0)
    for i, slots in enumerate((first, second, third)):
        waves.run(StepWave(slots, i, 3))
    for topk, slots in zip(runner.calls, (first, second, third), strict=True):
        on_the_slot_table(topk, slots)
    both = torch.where(first >= 0, first, second)
    assert torch.equal(waves.merged, expected(d, both))
