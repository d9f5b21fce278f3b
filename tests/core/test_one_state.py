"""One residency truth, whichever adapter and however a step runs.

Over every adapter (``helpers.one_state.ADAPTERS``: the stacked-experts ``torch.nn`` adapter and
SGLang's ``FusedMoE``), random interleavings on two paged layers of

- host steps: eager, more than K routed entries, in one, two or many waves;
- device steps: eager, at most K entries, planned and paged on the device planner;
- replays: the captured step (``capturing()`` true, as a CUDA graph records and replays it), of
  one wave or of several (of K // 2 experts each with ``MOEPAGE_DECODE_OVERLAP``);
- prefetches: layer 0's step prefetching layer 1's predicted experts, and direct
  ``LayerPager.prefetch`` calls of any shape, padding and size;

each equal the unpaged layer (``torch.equal``), and every layer's residency, slots, misses and
prefetches equal a replay of the policy's rule planned on the host (``Residency`` + ``plan_waves``,
and the prefetch rule written out); under LRU, layer 0 (never prefetched into) also follows an
independent LRU model (``helpers.reference.RefLRU``) entry for entry.
"""

from __future__ import annotations

import os
import random
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.one_state import ADAPTERS, PREPARE
from helpers.reference import RefLRU, assert_matches_ref, check_residency
from helpers.routing import draw_routing
from moepage import prefetch as prefetch_module
from moepage.residency import Residency, plan_waves

pytestmark = pytest.mark.usefixtures("single_thread")

OPS = ("host", "device", "replay", "prefetch", "prefetch_call")
EXAMPLES = {"transformers": 60, "sglang": 25}
# (E, top_k, K): K = top_k and K = E among them, odd and even K; SGLang's checkpoint is E = 8, top-2.
SHAPES = {"transformers": [(8, 2, 2), (8, 2, 3), (8, 2, 5), (8, 2, 8), (12, 3, 7), (16, 4, 4)],
          "sglang": [(8, 2, 2), (8, 2, 3), (8, 2, 5), (8, 2, 8)]}


def replay_prefetch(res: Residency, ids: torch.Tensor) -> int:
    """The prefetch rule, written out: the distinct valid ids as wave 0 of a step routing them
    (resident ones first, then missing ones, each ascending), at most K. Returns the loads."""
    distinct = sorted({i for i in ids.flatten().tolist() if 0 <= i < res.num_experts})
    first = [e for e in distinct if res.is_resident(e)] + [e for e in distinct if not res.is_resident(e)]
    return len(res.place(first[: res.num_slots]).loads)


def routing_for(op: str, rng: random.Random, e: int, k: int, top_k: int):
    """(tokens, distinct experts) of a step of ``op``: at most K entries for a device step, more
    for a host step, anything for a replay or a prefetching step."""
    if op == "device":
        tokens = rng.randint(1, max(1, k // top_k))
        return tokens, rng.randint(top_k, min(e, tokens * top_k))
    if op == "host":
        tokens = k // top_k + 1 + rng.randint(0, 3)
    else:
        tokens = rng.randint(1, 2 * e // top_k + 1)
    return tokens, rng.randint(top_k, min(e, tokens * top_k))


@pytest.fixture(params=list(ADAPTERS))
def adapter(request) -> str:
    PREPARE.get(request.param, lambda: None)()
    return request.param


def test_every_step_and_prefetch_keeps_one_state(adapter):
    @settings(max_examples=EXAMPLES[adapter], deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        shape=st.sampled_from(SHAPES[adapter]),
        dtype=st.sampled_from([torch.float32, torch.bfloat16]),
        policy=st.sampled_from(["lru", "lfu:3"]),
        impl=st.sampled_from(["eager", "grouped_mm", "batched_mm"]),
        overlap=st.booleans(),
        decode_overlap=st.booleans(),
        prefetch_top=st.sampled_from([1, 2, 5]),
        ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 1)), min_size=6, max_size=14),
        seed=st.integers(0, 2**31 - 1),
    )
    def run(shape, dtype, policy, impl, overlap, decode_overlap, prefetch_top, ops, seed):
        e, top_k, k = shape
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        with mock.patch.dict(os.environ, {"MOEPAGE_DECODE_OVERLAP": "on" if decode_overlap else "off"}), \
                ADAPTERS[adapter](e, top_k, k, dtype, policy, prefetch_top, impl=impl, overlap=overlap) as pair:
            replay = [Residency(e, k, policy) for _ in pair.pagers]
            lru = RefLRU(e, k)
            misses, prefetched = [0, 0], [0, 0]
            # An engine warms each layer up eagerly before capturing it (moepage checks the
            # implementation there): one device step per layer first.
            for i, (op, which) in enumerate([("device", 0), ("device", 1), *ops]):
                if op == "prefetch_call":
                    ids = torch.randint(-2, e + 2, (rng.randint(0, 6), rng.randint(1, 4)), generator=gen)
                    prefetch_module.prefetch(pair.pagers[1], ids)
                    prefetched[1] += replay_prefetch(replay[1], ids)
                else:
                    which = 0 if op == "prefetch" else which
                    tokens, distinct = routing_for(op, rng, e, k, top_k)
                    ids, ref_ids, routed = draw_routing(rng, tokens, top_k, e, rng.sample(range(e), distinct),
                                                        pad_frac=0.2 if pair.padding else 0.0)
                    x = torch.randn(tokens, pair.hidden, generator=gen).to(dtype)
                    w = torch.rand(tokens, top_k, generator=gen).to(dtype)
                    out, want = pair.step(which, x, ids, ref_ids, w, captured=op == "replay")
                    assert torch.equal(out, want), f"op {i} ({op}, layer {which})"
                    on_host = op != "replay" and ids.numel() > k  # else planned on the device: waves of K
                    split = pair.split and on_host and len(routed) > k and k >= 2
                    # device steps of more than K entries: waves of K // 2 with MOEPAGE_DECODE_OVERLAP
                    split |= decode_overlap and not on_host and min(e, ids.numel()) > k and k >= 2
                    waves = plan_waves(replay[which], routed, k // 2 if split else None)
                    misses[which] += sum(len(wave.loads) for wave in waves)
                    if which == 0:
                        lru.step(routed, k // 2 if split else None)
                    if which == 0:  # the step prefetched layer 1's predicted experts
                        prefetched[1] += replay_prefetch(replay[1], pair.predicted(x))
                for j, pager in enumerate(pair.pagers):
                    res = pager.read_residency()
                    check_residency(res)
                    assert res.table() == replay[j].table(), f"op {i} ({op}), layer {j}"
                    pager.check_slots()  # every resident slot holds its expert's host row
                    s = pager.read_stats()
                    assert (s.misses, s.prefetched) == (misses[j], prefetched[j]), f"op {i} ({op}), layer {j}"
                if policy == "lru":
                    assert_matches_ref(pair.pagers[0].read_residency(), lru)

    run()
