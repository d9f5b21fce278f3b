"""Each adapter's two paged MoE layers beside their unpaged twins, driven the same way: the one
property test of the one state (``tests/core/test_one_state.py``) runs over every adapter here.

A ``Pair`` steps layer ``which`` of the paged model and of the reference on the same inputs,
eagerly or as the captured step (``capture.capturing()`` true: what a CUDA graph records and
replays), and says what layer 1's router predicts from layer 0's input: what layer 0's step
prefetches into layer 1.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn.functional as F

import moepage
import moepage.capture as capture
from moepage.pager import LayerPager
from moepage.toy import ToyMoE

HIDDEN, INTER = 16, 8


@dataclass
class Pair:
    pagers: list[LayerPager]
    run: Callable  # (which, x, ids, ref_ids, w) -> (paged output, reference output)
    router: torch.Tensor  # layer 1's router weight: what layer 0's step prefetches from
    prefetch_top: int
    split: bool  # host steps of more than K experts run in waves of K // 2 (prefill_overlap)
    padding: bool  # routing may hold padding ids
    hidden: int

    def step(self, which: int, x, ids, ref_ids, w, captured: bool):
        with mock.patch.object(capture, "capturing", lambda: captured):
            return self.run(which, x, ids, ref_ids, w)

    def predicted(self, x: torch.Tensor) -> torch.Tensor:
        return torch.topk(F.linear(x, self.router.to(x.dtype)), self.prefetch_top, dim=-1).indices


@contextlib.contextmanager
def transformers_pair(e, top_k, k, dtype, policy, prefetch_top, impl="grouped_mm", overlap=False) -> Iterator[Pair]:
    """``moepage.wrap`` of a two-layer ``moepage.toy.ToyMoE`` (HF's stacked-experts shape)."""
    ref = ToyMoE(vocab=8, hidden=HIDDEN, inter=INTER, layers=2, num_experts=e, top_k=top_k,
                 implementation=impl).to(dtype)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=k, backend="torch", device_planner=True, prefill_overlap=overlap, policy=policy,
                 prefetch=prefetch_top)
    layers = list(moepage.paged_layers(paged))

    def run(which, x, ids, ref_ids, w):
        return paged.blocks[which].experts(x, ids, w), ref.blocks[which].experts(x, ref_ids, w)

    yield Pair([layer.pager for layer in layers], run, ref.blocks[1].router.weight, prefetch_top, overlap,
               padding=impl == "eager", hidden=HIDDEN)
    moepage.unwrap(paged)
    for name, param in ref.named_parameters():  # the module's own E rows back, as they were
        assert torch.equal(paged.get_parameter(name), param), name


@contextlib.contextmanager
def sglang_pair(e, top_k, k, dtype, policy, prefetch_top, **_) -> Iterator[Pair]:
    """Real ``FusedMoE`` layers of SGLang's Qwen3-MoE, loaded through SGLang's loader with the
    plugin's flags (``E = 8``, top-2 are the checkpoint's)."""
    from helpers import sglang as H

    assert (e, top_k) == (H.E, H.TOP_K), "the SGLang checkpoint is E = 8, top-2"
    env = {"MOEPAGE_DEVICE_PLANNER": "1", "MOEPAGE_POLICY": policy, "MOEPAGE_SGLANG_PREFETCH": str(prefetch_top)}
    with mock.patch.dict(os.environ, env):
        ref, paged = H.build_pair("qwen3_moe", dtype, k=k)
    refs, layers = H.moe_layers(ref), H.moe_layers(paged)
    gate = [m for m in paged.modules() if hasattr(m, "gate") and hasattr(m, "experts")][1].gate

    from sglang.srt.layers.moe.topk import StandardTopKOutput

    def run(which, x, ids, ref_ids, w):
        topk = StandardTopKOutput(topk_weights=w.float(), topk_ids=ids.to(torch.int32), router_logits=None)
        return H.forward(layers[which], x, topk), H.forward(refs[which], x, topk)

    yield Pair([layer.quant_method.pager for layer in layers], run, gate.weight, prefetch_top, split=False,
               padding=False, hidden=H.HIDDEN)


def prepare_sglang() -> None:
    """Once, from a fixture: SGLang's first import keeps the frames live at that moment (and so
    whatever they later hold), so it must not happen inside a test."""
    import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)

    from helpers import sglang as H

    H.setup_sglang()


ADAPTERS = {"transformers": transformers_pair, "sglang": sglang_pair}
PREPARE = {"sglang": prepare_sglang}
