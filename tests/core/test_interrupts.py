"""Ctrl-C during a paged step. A ``KeyboardInterrupt`` is delivered between two Python lines, so these tests raise
one at every line moepage runs in a step, one run each: at each point of a host-planned page-in, a device-planned one,
the copy pipeline, a prefetch, compressed rows and rows read from disk. Afterwards the model must still work: the next
call equals the unpaged model bit for bit, its counters read, and ``unwrap`` gives back the original weights without
being told to discard anything (an interrupted page-in is not an edit)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import moepage
from moepage.bits import same_bits
from moepage.toy import ToyMoE

pytestmark = pytest.mark.usefixtures("single_thread")

PACKAGE = str(Path(moepage.__file__).parent)
TOY = str(Path(moepage.__file__).parent / "toy.py")


class InterruptAt:
    """A tracer raising ``KeyboardInterrupt`` at the ``n``-th line moepage (not its toy model) runs."""

    def __init__(self, n: int):
        self.n, self.seen, self.fired = n, 0, False

    def _local(self, frame, event, arg):
        if event == "line" and not self.fired:
            self.seen += 1
            if self.seen == self.n:
                self.fired = True
                raise KeyboardInterrupt
        return self._local

    def __call__(self, frame, event, arg):
        file = frame.f_code.co_filename
        if file.startswith(PACKAGE) and file != TOY:
            return self._local
        return None


def interrupted(model, ids, n: int) -> bool:
    """Run ``model(ids)`` interrupted at moepage's n-th line; whether the interrupt fired."""
    tracer = InterruptAt(n)
    sys.settrace(tracer)
    try:
        model(ids)
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return tracer.fired


def model_pair(dtype=torch.float32, layers: int = 2):
    torch.manual_seed(0)
    model = ToyMoE(vocab=40, hidden=16, inter=8, layers=layers, num_experts=8, top_k=2).to(dtype).eval()
    return model, copy.deepcopy(model)


CASES = {
    # A multi-wave prompt (host-planned) then one-token steps (device-planned where the planner is on).
    "host_planned": dict(device_planner=False),
    "device_planned": dict(device_planner=True),
    "copy_pipeline": dict(device_planner=False, prefill_overlap=True),
    "prefetch": dict(device_planner=True, prefetch=True),
    "compressed": dict(device_planner=True, compress=True),
    "disk_tier": dict(host_budget=4),  # rows on disk (spill_dir: the test's), host-planned
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_interrupt_at_any_line_of_a_step_leaves_the_model_exact(case, tmp_path):
    options = dict(CASES[case], **({"spill_dir": tmp_path} if "host_budget" in CASES[case] else {}))
    dtype = torch.bfloat16 if options.get("compress") else torch.float32
    model, reference = model_pair(dtype, layers=2 if options.get("prefetch") else 1)
    moepage.wrap(model, 3, backend="torch", **options)
    prompts = [torch.arange(0, 12) % 40, torch.tensor([7])]  # a step of many waves (host-planned), one of one
    fired = 0
    for ids in prompts:
        n = 1
        while interrupted(model, ids, n):
            fired += 1
            for check in prompts:  # every later call works and is exact (host- and device-planned alike)
                assert same_bits(model(check), reference(check)), f"{case}: after an interrupt at line {n}"
            n += 1
        assert n > 10, "the tracer saw moepage's lines"
    moepage.stats(model)
    moepage.unwrap(model)  # no slot edit was made: nothing to discard
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert same_bits(got, want), name
    assert fired > 100
