"""THE paged step, for every adapter: which planner, the waves, the order of page-ins and computation, and the
reduction. The layer's state and its primitive writes (page-in, gather, with their repair on
failure) are the pager's (``moepage.pager``); the rule deciding what goes where is ``moepage.residency``'s.

An adapter keeps its hidden states and hands the step a ``StepComputation`` (run one wave over slot ids; reduce at
the end). ``paged_step`` plans on the device for steps of at most K entries and for any step under capture, on the
host otherwise.

- ``device_step`` is the step a CUDA graph captures: ⌈min(E, entries) / K⌉ waves fixed by shapes, reading and writing
  device state only. With ``skip_empty_waves`` a replay skips the waves its routing leaves empty (graph if-nodes; a
  runner's later waves write into what its first wave made); with ``decode_overlap`` a step of more than K experts
  takes waves of K // 2, each planned and paged in on the copy stream beside the previous wave's computation
  (``overlapped_device_step``). Both are off by default: see bench/RESULTS.md for what they measured.
- ``host_step`` pages wave by wave through the ``CopyPipeline`` (wave i+1 beside wave i's computation with
  ``overlap``) and writes the state back before returning, also on failure.
- ``after_page_in`` runs once per step, after the first page-in is issued: where the next layer's prefetch goes
  (``moepage.prefetch``).

``WaveStreams`` is the one rule of overlapped waves: on CUDA, wave i is paged in on a copy stream after the
computation of wave i - 2 (whose slots it may take; waves of at most K // 2 never take the previous one's), and wave
i's computation waits for its page-in; without a copy stream everything runs in order on one stream.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from . import capture
from .errors import ConfigError
from .pager import LayerPager
from .residency import Wave, plan_waves

AfterPageIn = Callable[[], None]


@dataclass(frozen=True)
class StepWave:
    """Wave ``index`` of ``count``: ``slots`` (shaped like the routing) holds each served entry's
    slot, ``-1`` for the others, or K in the one wave of a step its runner runs ``direct``ly (every
    routed entry is in it)."""

    slots: torch.Tensor
    index: int
    count: int
    direct: bool = False


class StepComputation(Protocol):
    """An adapter's computation for one step, over its own hidden states."""

    #: A step of one wave may run as the layer's own computation on slot ids (padding on slot K).
    direct: bool

    def run(self, wave: StepWave) -> None:
        """Compute the entries of ``wave`` (keeping them for ``finish``, or the output itself)."""

    def finish(self) -> torch.Tensor:
        """The step's output: its entries reduced as the unpaged layer reduces them."""


# -- which planner, how many waves --------------------------------------------------------------------------------
def plans_on_device(pager: LayerPager, entries: int) -> bool:
    """On the device: a step of at most K entries, and any step under capture (a replay runs no Python) or
    ``capture_mode``; a larger eager step on the host (the copy engine pages it), and every step of a split layer."""
    if pager.split is not None:
        if capture.in_capture_mode():
            raise ConfigError(
                f"layer {pager.name}: {_capturing()}, but cpu_share splits each step's misses between the link and "
                "the CPU, which a step planned on the device (a captured step) cannot; run this model eagerly (no "
                "CUDA graphs, no torch.compile of the experts), or without cpu_share"
            )
        return False
    if pager.device_state is None:
        if capture.in_capture_mode():
            raise ConfigError(
                f"layer {pager.name}: {_capturing()}, but this layer plans its steps on the host (the "
                f"{pager.store.name} store, device_planner={pager.config.device_planner}); capture_mode plans every "
                "step on the device: wrap with device_planner=True (the cuda backend on CUDA, torch on the CPU)"
            )
        return False
    return entries <= pager.num_slots or capture.in_capture_mode()


def _capturing() -> str:
    """What plans every step on the device now, as a refusal says it."""
    return "a CUDA graph is being captured" if capture.capturing() else "moepage.capture_mode() is on"


def device_wave_width(pager: LayerPager, entries: int) -> int:
    """The experts a wave of a device-planned step of ``entries`` routed entries takes: K, or K // 2 where
    ``decode_overlap`` pages each wave in beside the previous one's computation (a step of more than K)."""
    k = pager.num_slots
    overlapped = pager.config.decode_overlap and k >= 2 and min(pager.num_experts, entries) > k
    return k // 2 if overlapped else k


def device_wave_count(pager: LayerPager, entries: int) -> int:
    """Waves of a device-planned step of ``entries`` routed entries: fixed by shapes alone."""
    return max(1, math.ceil(min(pager.num_experts, entries) / device_wave_width(pager, entries)))


def host_wave_size(pager: LayerPager, distinct: int) -> int | None:
    """A host-planned step's wave size: K (None), or with ``overlap`` half the room admission leaves, so no wave's
    page-in reuses the slots of the wave computing beside it."""
    room = min(pager.config.admit or pager.num_slots, pager.num_slots)
    split = pager.config.overlap and distinct > pager.num_slots and room >= 2
    return room // 2 if split else None


# -- the steps ----------------------------------------------------------------------------------------------------
def paged_step(pager: LayerPager, ids: torch.Tensor, computation: StepComputation,
               after_page_in: AfterPageIn | None = None) -> torch.Tensor:
    """One step of the layer: routing ``ids`` [T, k] (ids < 0 or >= E are padding)."""
    if plans_on_device(pager, ids.numel()):
        return device_step(pager, ids, computation, after_page_in)
    return host_step(pager, ids, computation, after_page_in)


def device_step(pager: LayerPager, ids: torch.Tensor, computation: StepComputation,
                after_page_in: AfterPageIn | None = None) -> torch.Tensor:
    """The captured step: planned and paged on the device, wave by wave, with no host sync."""
    pager.settle()
    pager.await_prefetch()
    state, k, entries = pager.require_device_state(), pager.num_slots, ids.numel()
    count, width = device_wave_count(pager, entries), device_wave_width(pager, entries)
    ranks = state.ranks(ids) if count > 1 else None
    if width < k:
        return _overlapped_device_step(pager, ids, computation, ranks, count, width, after_page_in)
    pad = k if count == 1 and computation.direct else -1
    # With skip_empty_waves, a replay skips the waves past the step's highest rank (if-nodes): an empty wave changes
    # no state, so skipping it leaves every output and counter as it was.
    skips = ranks is not None and pager.config.skip_empty_waves and capture.conditionals()
    top = ranks.amax() if skips else None
    for w in range(count):
        with capture.only_if(None if top is None or w == 0 else top >= w * k):
            pager.begin_write()  # the state names the wave's experts before the gather copies them
            slots = state.plan(ids, pad, ranks, w, width)
            pager.gather()
            if w == 0 and after_page_in is not None:
                after_page_in()
            computation.run(StepWave(slots, w, count, pad >= 0))
    _finish(pager)
    return computation.finish()


def _overlapped_device_step(pager: LayerPager, ids: torch.Tensor, computation: StepComputation,
                            ranks: torch.Tensor, count: int, width: int,
                            after_page_in: AfterPageIn | None) -> torch.Tensor:
    """The captured step in waves of K // 2: wave w is planned and paged in on the copy stream while wave w - 1
    computes (it evicts wave w - 1's slots last, so it takes none of them), after wave w - 2's computation, whose slots
    it may take (``WaveStreams``). Its page-ins take the step's full grid, not the background grid a prefetch takes
    (bench/RESULTS.md). No host sync; off CUDA the same waves run in order."""
    state = pager.require_device_state()
    outs = [torch.empty_like(ids) for _ in range(count)]  # on the step's stream, which reads them
    streams = wave_streams(pager)
    for w in range(count):
        with streams.paging():
            pager.begin_write()
            slots = state.plan(ids, -1, ranks, w, width, out=outs[w])
            pager.gather()
        streams.ready(w)
        if w == 0 and after_page_in is not None:
            after_page_in()
        computation.run(StepWave(slots, w, count))
        streams.computed()
    streams.drain()
    _finish(pager)
    return computation.finish()


def host_step(pager: LayerPager, ids: torch.Tensor, computation: StepComputation,
              after_page_in: AfterPageIn | None = None) -> torch.Tensor:
    """A step planned on the host, in as many waves as its distinct experts need (less those of its CPU share, where
    the layer splits: ``moepage.split``)."""
    pager.settle()
    pager.await_prefetch()
    distinct = pager.read_state(ids)
    share = None if pager.split is None else pager.split.begin(pager, ids, distinct, computation)
    if share is not None:  # the CPU computes these beside the waves: not placed, not paged
        distinct = [e for e in distinct if e not in share.experts]
    size = host_wave_size(pager, len(distinct))
    waves = _place_waves(pager, distinct, size)  # (a share starts at its join: nothing to stop before it)
    pad = pager.num_slots if len(waves) == 1 and computation.direct and share is None else -1
    e = pager.num_experts
    entries = torch.where((ids >= 0) & (ids < e), ids, e).to(pager.device)  # padding: index E, slot -1
    pipe = CopyPipeline(pager.page_in, lambda wave: _slot_map(pager, wave), pager.device,
                        wave_streams(pager, overlapped=size is not None))
    ahead = 1 if size is not None else 0  # waves whose page-in is issued before the running one computes
    agreed = False  # whether the state written back says what the slots hold (else ``settle`` repairs it)
    try:
        for i, wave in enumerate(waves):
            while pipe.issued <= min(i + ahead, len(waves) - 1):
                pipe.issue(waves[pipe.issued])
            if i == 0 and after_page_in is not None:
                after_page_in()
            to_slot = pipe.ready(i)
            pager.counts.waves += 1
            pager.counts.hits += wave.hits
            slots = to_slot if pad < 0 else to_slot.masked_fill(to_slot < 0, pad)
            computation.run(StepWave(slots[entries], i, len(waves), pad >= 0))
            pipe.computed()
        if share is not None:
            share.join(pager, computation)
        agreed = True
    except BaseException:
        # Waves placed up front but not paged in: their slots do not hold what the state says.
        pager.residency.invalidate(s for w in waves[pipe.issued:] for _, s in w.loads)
        pipe.drain()
        agreed = True
        raise
    finally:
        pager.write_state()
        if agreed:
            pager.end_write()
    if not waves and after_page_in is not None:  # nothing routed: still once per step
        after_page_in()
    _finish(pager)
    return computation.finish()


def _place_waves(pager: LayerPager, distinct: list[int], wave_size: int | None) -> list[Wave]:
    """Place a host-planned step's waves on the pager's host state and count the step (a failure leaves the state
    as it was)."""
    before = pager.residency.table()
    pager.begin_write()  # until the step writes its state back
    try:
        waves = plan_waves(pager.residency, distinct, wave_size, admit=pager.config.admit)
    except BaseException:
        pager.residency.load_table(before)  # nothing was paged: the step never happened
        pager.end_write()
        raise
    pager.counts.steps += 1
    return waves


def _slot_map(pager: LayerPager, wave: Wave) -> torch.Tensor:
    """``[E + 1]`` on the host: the slot of each expert of ``wave``, -1 elsewhere (E: padding)."""
    to_slot = torch.full((pager.num_experts + 1,), -1, dtype=torch.long, device="cpu")
    to_slot[list(wave.experts)] = torch.tensor(wave.slots, dtype=torch.long, device="cpu")
    return to_slot


def _finish(pager: LayerPager) -> None:
    """After every step: verify (eager) and the periodic log line."""
    if capture.capturing():
        return
    if pager.config.verify:
        pager.check_slots()
    pager.log.stepped(pager.read_stats)


# -- streams of overlapped waves ----------------------------------------------------------------------------------
def wave_streams(pager: LayerPager, overlapped: bool = True) -> WaveStreams:
    """A step's streams: with ``overlapped``, the layer's copy stream beside the step's (CUDA); else one stream."""
    on_copy = overlapped and pager.device.type == "cuda"
    return WaveStreams(pager.device, pager.copy_stream() if on_copy else None)


class WaveStreams:
    """The compute stream and an optional copy stream of one step, and the events between their waves."""

    def __init__(self, device: torch.device, copy_stream: torch.cuda.Stream | None = None):
        self.copy = copy_stream
        self.copied: list[torch.cuda.Event] = []  # wave i paged in (on the copy stream)
        self.done: list[torch.cuda.Event] = []  # wave i computed (on the compute stream)
        if self.copy is not None:
            self.compute = torch.cuda.current_stream(device)
            self.copy.wait_stream(self.compute)  # earlier work on these slots comes first

    @contextmanager
    def paging(self) -> Iterator[None]:
        """Inside: the next wave's page-in work, on the copy stream after the computation of the wave two before."""
        if self.copy is None:
            yield
            return
        wave = len(self.copied)
        if wave >= 2:
            self.copy.wait_event(self.done[wave - 2])
        with torch.cuda.stream(self.copy):
            yield
            event = torch.cuda.Event()
            event.record(self.copy)
        self.copied.append(event)

    def ready(self, wave: int) -> None:
        """The compute stream waits for wave ``wave``'s page-in."""
        if self.copy is not None:
            self.compute.wait_event(self.copied[wave])

    def computed(self) -> None:
        """After a wave's computation is queued."""
        if self.copy is not None:
            event = torch.cuda.Event()
            event.record(self.compute)
            self.done.append(event)

    def drain(self) -> None:
        """At the step's end, or after a failure: later work must not overtake page-ins already issued."""
        if self.copy is not None:
            self.compute.wait_stream(self.copy)


class CopyPipeline:
    """Page-ins and slot maps of one host-planned step, wave by wave (``streams`` without a copy stream
    serializes). The slot map goes on the copy stream too: from the compute stream it would queue behind the next
    wave's rows on the same copy engine."""

    def __init__(self, page_in: Callable[[Sequence[tuple[int, int]]], None], slot_map: Callable[[Wave], torch.Tensor],
                 device: torch.device, streams: WaveStreams):
        self.page_in, self.slot_map, self.device, self.streams = page_in, slot_map, device, streams
        self.issued = 0  # waves whose page-in completed (on the host side)
        self.maps: list[torch.Tensor] = []

    def issue(self, wave: Wave) -> None:
        to_slot = self.slot_map(wave)
        if self.streams.copy is None:
            self.page_in(wave.loads)
            self.maps.append(to_slot.to(self.device, non_blocking=True))
        else:
            # Allocated on the compute stream, which reads it; the copy stream waited for all compute queued so far.
            on_device = torch.empty_like(to_slot, device=self.device)
            with self.streams.paging():
                on_device.copy_(to_slot.pin_memory(), non_blocking=True)
                self.page_in(wave.loads)
            self.maps.append(on_device)
        self.issued += 1

    def ready(self, wave: int) -> torch.Tensor:
        """The slot map of ``wave``, once the compute stream may use it and the wave's rows."""
        self.streams.ready(wave)
        return self.maps[wave]

    def computed(self) -> None:
        self.streams.computed()

    def drain(self) -> None:
        """After a failure: later work must not overtake page-ins already issued."""
        self.streams.drain()
