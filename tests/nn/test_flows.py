"""The flows serving engines run, end to end: captured decode replayed between eager host-planned
steps, and Hugging Face static-cache decoding of a left-padded batch whose prefill is planned on
the host and whose decode steps are captured in one CUDA graph (``moepage.integrations.transformers.decode``).

GPU tests (marked ``gpu``) capture real CUDA graphs with the ``cuda`` backend; the CPU tests run
the same loops eagerly, with the device planner on the CPU inside ``moepage.capture_mode()`` (the
path a capture takes), so CI covers the mechanics.
"""

from __future__ import annotations

import copy

import pytest
import torch

import moepage
from helpers.flows import PROMPTS, decode_equal, hf_experts, rounds, tiny_qwen3_moe
from moepage.integrations.transformers.decode import greedy


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_device_and_host_rounds_hf_experts_on_cpu(impl, dtype, single_thread):
    """The same rounds on the CPU without graphs: host waves between device-planned steps of one
    and of three waves, on HF's own experts module under each implementation."""
    ref, hidden = hf_experts(impl, dtype=dtype, device="cpu", hidden=32)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=8, backend="torch", device_planner=True, policy="lru")
    rounds(paged, ref, 32, 4, hidden, dtype, torch.Generator().manual_seed(5), capture=False, rounds=4)


# -- Hugging Face static-cache decoding ----------------------------------------------------------


def test_static_cache_decode_on_cpu_equals_unpaged():
    """The same loop on the CPU: eager, with the device planner on the CPU (decode steps of 12
    entries > K = 8 run as device-planned waves inside capture_mode, prefill in host waves)."""
    decode_equal("cpu", torch.float32, graph=False, backend="torch", device_planner=True)
    for dtype in (torch.float32, torch.bfloat16):
        ref = tiny_qwen3_moe("batched_mm", dtype, "cpu")
        paged = copy.deepcopy(ref)
        moepage.wrap(paged, resident=8, backend="torch", device_planner=True)
        want = greedy(ref, PROMPTS, new_tokens=6)
        with moepage.capture_mode():  # every step on the device planner, prefill included
            got = greedy(paged, PROMPTS, new_tokens=6)
        assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        layer = next(moepage.paged_layers(paged))
        assert int(layer.pager.device_state.counters[0]) == 7  # one prefill + six decode steps
        assert moepage.stats(paged).total.waves > 7  # several device waves per step
