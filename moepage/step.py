"""THE paged step, for every adapter: plan, page in, run wave by wave, reduce.

An adapter keeps its hidden states and hands the step a ``WaveRunner`` (run one wave over slot
ids; reduce at the end). ``paged_step`` plans on the device for steps of at most K entries and
for any step under capture, on the host otherwise. ``device_step`` is the step a CUDA graph
captures: ⌈min(E, entries) / K⌉ waves fixed by shapes, reading and writing device state only; with
``MOEPAGE_SKIP_EMPTY_WAVES`` a replay skips the waves its routing leaves empty, as graph if-nodes
(a runner's later waves write into what its first wave made); with ``MOEPAGE_DECODE_OVERLAP`` a step of
more than K experts takes waves of K // 2, each planned and paged in on the copy stream beside the
previous wave's computation (``overlapped_device_step``).
``host_step`` pages through the copy pipeline (wave i+1 beside wave i's compute with overlap) and
writes the state back before returning, also on failure. ``after_page_in`` runs once per step,
after the first page-in is issued (where the next layer's prefetch goes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from . import capture
from .pager import LayerPager

AfterPageIn = Callable[[], None]


@dataclass(frozen=True)
class StepWave:
    """Wave ``index`` of ``count``: ``slots`` (shaped like the routing) holds each served entry's
    slot, ``-1`` for the others, or K in the one wave of a step its runner runs directly."""

    slots: torch.Tensor
    index: int
    count: int


class WaveRunner(Protocol):
    """An adapter's computation for one step, over its own hidden states."""

    #: A step of one wave may run as the layer's own computation on slot ids (padding on slot K).
    direct: bool

    def run(self, wave: StepWave) -> None:
        """Compute the entries of ``wave`` (keeping them for ``finish``, or the output itself)."""

    def finish(self) -> torch.Tensor:
        """The step's output: its entries reduced as the unpaged layer reduces them."""


def paged_step(pager: LayerPager, ids: torch.Tensor, runner: WaveRunner,
               after_page_in: AfterPageIn | None = None) -> torch.Tensor:
    """One step of the layer: routing ``ids`` [T, k] (ids < 0 or >= E are padding)."""
    if pager.plans_on_device(ids.numel()):
        return device_step(pager, ids, runner, after_page_in)
    return host_step(pager, ids, runner, after_page_in)


def device_step(pager: LayerPager, ids: torch.Tensor, runner: WaveRunner,
                after_page_in: AfterPageIn | None = None) -> torch.Tensor:
    """The captured step: planned and paged on the device, wave by wave, with no host sync."""
    pager.settle()
    pager.await_prefetch()
    count = pager.device_wave_count(ids.numel())
    ranks = pager.device_ranks(ids)
    if pager.device_wave_width(ids.numel()) < pager.num_slots:
        return overlapped_device_step(pager, ids, runner, ranks, count, after_page_in)
    pad = pager.num_slots if count == 1 and runner.direct else -1
    # The wave count covers any routing; opted in, a replay skips the waves past the step's highest rank (if-nodes).
    # An empty wave changes no state, so skipping it leaves every output and counter as it was. Off by default: on an
    # H200 a skipped wave saved 141 us of a 497 us step, but on real routing skipping gained nothing (RESULTS.md).
    skips = ranks is not None and pager.config.skip_empty_waves and capture.conditionals()
    top = ranks.amax() if skips else None
    for w in range(count):
        with capture.only_if(None if top is None or w == 0 else top >= w * pager.num_slots):
            slots = pager.plan_device_wave(ids, pad, ranks, w)
            pager.gather()
            if w == 0 and after_page_in is not None:
                after_page_in()
            runner.run(StepWave(slots, w, count))
    pager.finish_step()
    return runner.finish()


def overlapped_device_step(pager: LayerPager, ids: torch.Tensor, runner: WaveRunner, ranks: torch.Tensor,
                           count: int, after_page_in: AfterPageIn | None = None) -> torch.Tensor:
    """The captured step in waves of K // 2: wave w is planned and paged in on the copy stream while wave w - 1
    computes (it evicts wave w - 1's slots last, so it takes none of them), after wave w - 2's computation, whose slots
    it may take (``pipeline.WaveStreams``). Its page-ins take the step's full grid: on the store's background grid, as a
    prefetch takes, such steps ran 14-17 % slower on an H200. No host sync; off CUDA the same waves run in order."""
    outs = [torch.empty_like(ids) for _ in range(count)]  # on the step's stream, which reads them
    streams = pager.wave_streams()
    for w in range(count):
        with streams.paging():
            slots = pager.plan_device_wave(ids, -1, ranks, w, out=outs[w])
            pager.gather()
        streams.ready(w)
        if w == 0 and after_page_in is not None:
            after_page_in()
        runner.run(StepWave(slots, w, count))
        streams.computed()
    streams.drain()
    pager.finish_step()
    return runner.finish()


def host_step(pager: LayerPager, ids: torch.Tensor, runner: WaveRunner,
              after_page_in: AfterPageIn | None = None) -> torch.Tensor:
    """A step planned on the host, in as many waves as its distinct experts need."""
    pager.settle()
    pager.await_prefetch()
    distinct = pager.read_state(ids)
    size = pager.wave_size(len(distinct))
    waves = pager.place_waves(distinct, size)
    pad = pager.num_slots if len(waves) == 1 and runner.direct else -1
    e = pager.num_experts
    entries = torch.where((ids >= 0) & (ids < e), ids, e).to(pager.device)  # padding: index E, slot -1
    pipe = pager.copy_pipeline(overlapped=size is not None)
    ahead = 1 if size is not None else 0  # waves whose page-in is issued before the running one computes
    agreed = False  # whether the state written back says what the slots hold (else ``settle`` repairs it)
    try:
        for i, wave in enumerate(waves):
            while pipe.issued <= min(i + ahead, len(waves) - 1):
                pipe.issue(waves[pipe.issued])
            if i == 0 and after_page_in is not None:
                after_page_in()
            to_slot = pipe.ready(i)
            pager.count_wave(wave)
            slots = to_slot if pad < 0 else to_slot.masked_fill(to_slot < 0, pad)
            runner.run(StepWave(slots[entries], i, len(waves)))
            pipe.computed()
        agreed = True
    except BaseException:
        pager.abandon(waves[pipe.issued:])  # placed up front: their slots do not hold what the state says
        pipe.drain()
        agreed = True
        raise
    finally:
        pager.write_state()
        if agreed:
            pager.end_write()
    if not waves and after_page_in is not None:  # nothing routed: still once per step
        after_page_in()
    pager.finish_step()
    return runner.finish()
