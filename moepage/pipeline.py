"""Wave page-ins ahead of the computation: the rule both planners' overlapped steps share, and the host-planned
step's page-ins in wave order.

``WaveStreams`` owns the rule: on CUDA, wave i is paged in on a copy stream after the computation of wave i - 2 (whose
slots it may take; waves of at most K // 2 never take the previous one's), and wave i's computation waits for its
page-in; without a copy stream (the default, and off CUDA) everything runs in order on one stream.
``CopyPipeline`` knows no residency: it calls the layer's ``page_in`` and ``slot_map`` wave by wave (host-planned
steps, ``prefill_overlap``). The slot map goes on the copy stream too: from the compute stream it would queue behind the
next wave's rows on the same copy engine. The device-planned overlapped step (``step.overlapped_device_step``) plans
and gathers each wave inside ``WaveStreams.paging``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from .residency import Wave


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
    """Page-ins and slot maps of one host-planned step. ``streams`` without a copy stream serializes."""

    def __init__(
        self,
        page_in: Callable[[Sequence[tuple[int, int]]], None],
        slot_map: Callable[[Wave], torch.Tensor],
        device: torch.device,
        streams: WaveStreams,
    ):
        self.page_in = page_in
        self.slot_map = slot_map
        self.device = device
        self.streams = streams
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
