"""Captured steps skip the waves their routing leaves empty (``capture.only_if``: graph if-nodes).

A CPU has no CUDA graphs, so a recorder stands in for the capture: it takes each if-node's
predicate and what the node's body changed. The body runs either way here; what must hold is that
a wave whose predicate is false is empty (skipping it changes no state, slot, counter or output)
and that later waves write into the buffer the first wave made (a skipped body allocates nothing
that is read afterwards). The replays themselves are ``tests/gpu/test_flows_gpu.py``'s."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import moepage
from helpers.models import device_forward, layer_of
from helpers.routing import draw_routing, random_inputs
from helpers.support import IMPLS
from moepage import capture, step
from moepage.nn import layer as layer_module
from moepage.toy import ToyExperts

pytestmark = pytest.mark.usefixtures("single_thread")

H, I = 16, 8


class IfNodeRecorder:
    """A capture that takes if-nodes: per node, its predicate and the state before and after its body."""

    def __init__(self, paged: torch.nn.Module, pager) -> None:
        self.paged, self.pager, self.waves = paged, pager, None
        self.nodes: list[dict] = []

    def snapshot(self) -> dict:
        merged = None if self.waves is None else self.waves.merged
        return {"state": self.pager.device_state.table.clone(), "counters": self.pager.device_state.counters.clone(),
                "slots": [p.detach().clone() for p in self.paged.parameters()],
                "merged": None if merged is None else merged.clone(),
                "merged_at": None if merged is None else merged.data_ptr()}

    def begin_capture_to_if_node(self, pred: torch.Tensor) -> None:
        assert pred.dtype == torch.bool and pred.dim() == 0
        self.nodes.append({"pred": bool(pred), "before": self.snapshot()})

    def end_capture_to_conditional_node(self) -> None:
        self.nodes[-1]["after"] = self.snapshot()


@pytest.fixture
def recorded(monkeypatch):
    """``make(paged, layer)``: the recorder device steps of ``layer`` capture their if-nodes into."""
    def make(paged, layer):
        rec = IfNodeRecorder(paged, layer.pager)
        run = layer_module.ModuleWaves.run

        def spied(self, wave):
            rec.waves = self
            run(self, wave)

        monkeypatch.setattr(layer_module.ModuleWaves, "run", spied)
        monkeypatch.setattr(capture, "conditionals", lambda: True)
        monkeypatch.setattr(capture, "_capturing_graph", lambda: rec)
        return rec
    return make


def _same(a: dict, b: dict) -> bool:
    tensors = [(a["state"], b["state"]), (a["counters"], b["counters"]), *zip(a["slots"], b["slots"])]
    if a["merged"] is not None:
        tensors.append((a["merged"], b["merged"]))
    return all(torch.equal(x, y) for x, y in tensors)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_waves_past_the_routing_are_if_nodes_that_change_nothing(recorded, monkeypatch, impl, dtype):
    """Steps of more than K entries routing 1, 2 and many waves' worth of experts, K = top_k and K = E / 2: every
    wave after the first is an if-node on "some rank reaches it"; a false one leaves everything as it was; later
    waves merge in place; and the step equals the unpaged layer's."""
    e, top_k = 16, 2
    monkeypatch.setenv("MOEPAGE_SKIP_EMPTY_WAVES", "on")  # read at wrap
    for k, seed in ((top_k, 1), (e // 2, 2)):
        torch.manual_seed(seed)
        ref = ToyExperts(e, H, I, top_k, impl).to(dtype)
        paged = copy.deepcopy(ref)
        moepage.wrap(paged, resident=k, backend="torch", device_planner=True, policy="lru")
        layer = layer_of(paged)
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        for distinct in (top_k, k, k + 1, 2 * k, min(e, 3 * k + 1), e):
            tokens = max(-(-distinct // top_k), k // top_k + 1)  # more than K entries: several waves fixed by shapes
            ids, ref_ids, _ = draw_routing(rng, tokens, top_k, e, rng.sample(range(e), distinct))
            x, w = random_inputs(tokens, H, top_k, dtype, gen)
            rec = recorded(paged, layer)
            out = device_forward(layer, x, ids, w)
            assert torch.equal(out, ref(x, ref_ids, w)), (k, distinct)
            count = step.device_wave_count(layer.pager, ids.numel())
            assert [n["pred"] for n in rec.nodes] == [distinct > i * k for i in range(1, count)], (k, distinct)
            for node in rec.nodes:
                if not node["pred"]:
                    assert _same(node["before"], node["after"]), f"a skippable wave changed state (K={k})"
                if node["before"]["merged_at"] is not None:
                    assert node["after"]["merged_at"] == node["before"]["merged_at"], "a later wave re-made its merge"


def toy_pair(seed: int, e: int = 16, top_k: int = 2, k: int = 8):
    """(unpaged toy experts, the paged copy at K, its paged layer), wrapped with the environment's settings."""
    torch.manual_seed(seed)
    ref = ToyExperts(e, H, I, top_k)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=k, backend="torch", device_planner=True)
    return ref, paged, layer_of(paged)


@pytest.mark.parametrize("skip", ["", "off", "on"])
def test_if_nodes_only_where_opted_in_and_for_more_than_one_wave(recorded, monkeypatch, skip):
    """Off by default; on, a step of one wave (at most K entries) has no predicate to take."""
    top_k = 2
    monkeypatch.setenv("MOEPAGE_SKIP_EMPTY_WAVES", skip)
    ref, paged, layer = toy_pair(4)
    rec = recorded(paged, layer)
    gen = torch.Generator().manual_seed(4)
    x, w = random_inputs(3, H, top_k, torch.float32, gen)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    assert torch.equal(device_forward(layer, x, ids, w), ref(x, ids, w))
    assert rec.nodes == []  # 6 entries <= K: one wave
    x, w = random_inputs(8, H, top_k, torch.float32, gen)  # 16 entries: two waves
    ids = torch.arange(16).view(8, 2)
    assert torch.equal(device_forward(layer, x, ids, w), ref(x, ids, w))
    assert [n["pred"] for n in rec.nodes] == ([True] if skip == "on" else [])


def test_overlapped_waves_take_no_if_nodes(recorded, monkeypatch):
    """With MOEPAGE_DECODE_OVERLAP too, a step of more than K runs every one of its waves of K // 2 (the copy stream's
    events between waves are not captured into if-nodes), and equals the unpaged layer's."""
    top_k = 2
    monkeypatch.setenv("MOEPAGE_SKIP_EMPTY_WAVES", "on")
    monkeypatch.setenv("MOEPAGE_DECODE_OVERLAP", "on")
    ref, paged, layer = toy_pair(5)
    rec = recorded(paged, layer)
    x, w = random_inputs(8, H, top_k, torch.float32, torch.Generator().manual_seed(5))
    ids = torch.tensor([[0, 1]] * 8)  # 16 entries routing 2 experts: waves 2 to 4 of 4 are empty
    assert torch.equal(device_forward(layer, x, ids, w), ref(x, ids, w))
    assert rec.nodes == [] and step.device_wave_count(layer.pager, ids.numel()) == 4


def test_conditionals_need_a_capture_by_torch(monkeypatch):
    assert not capture.conditionals()  # no capture on this machine
    monkeypatch.setattr(capture, "capturing", lambda: True)
    monkeypatch.setattr(capture, "_capturing_graph", lambda: object())
    assert capture.conditionals() == hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")
    monkeypatch.setattr(capture, "_capturing_graph", lambda: None)  # a capture torch's CUDAGraph did not begin
    assert not capture.conditionals()
