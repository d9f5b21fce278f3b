"""The page-ins of one host-planned step in wave order, optionally ahead of the computation (``prefill_overlap``).

``CopyPipeline`` knows no residency: it calls the layer's ``page_in`` and ``slot_map`` wave by wave, on the compute
stream (serialized: the default, and off CUDA) or on a copy stream after the compute of the wave two before (whose slots
it may reuse; waves of <= K // 2 never reuse the previous one's), the compute waiting on an event. The slot map goes
on the copy stream too: from the compute stream it would queue behind the next wave's rows on the same copy engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .residency import Wave


class CopyPipeline:
    """Page-ins and slot maps of one host-planned step. ``copy_stream``: None serializes."""

    def __init__(
        self,
        page_in: Callable[[Sequence[tuple[int, int]]], None],
        slot_map: Callable[[Wave], torch.Tensor],
        device: torch.device,
        copy_stream: torch.cuda.Stream | None = None,
    ):
        self.page_in = page_in
        self.slot_map = slot_map
        self.device = device
        self.copy = copy_stream
        self.issued = 0  # waves whose page-in completed (on the host side)
        self.maps: list[torch.Tensor] = []
        self.copied: list[torch.cuda.Event] = []
        self.done: list[torch.cuda.Event] = []
        if self.copy is not None:
            self.compute = torch.cuda.current_stream(device)
            self.copy.wait_stream(self.compute)  # earlier work on these slots comes first

    def issue(self, wave: Wave) -> None:
        to_slot = self.slot_map(wave)
        if self.copy is None:
            self.page_in(wave.loads)
            self.maps.append(to_slot.to(self.device, non_blocking=True))
        else:
            if self.issued >= 2:
                self.copy.wait_event(self.done[self.issued - 2])
            # Allocated on the compute stream, which reads it; the copy stream waited for all compute queued so far.
            on_device = torch.empty_like(to_slot, device=self.device)
            with torch.cuda.stream(self.copy):
                on_device.copy_(to_slot.pin_memory(), non_blocking=True)
                self.page_in(wave.loads)
                event = torch.cuda.Event()
                event.record(self.copy)
            self.maps.append(on_device)
            self.copied.append(event)
        self.issued += 1

    def ready(self, wave: int) -> torch.Tensor:
        """The slot map of ``wave``, once the compute stream may use it and the wave's rows."""
        if self.copy is not None:
            self.compute.wait_event(self.copied[wave])
        return self.maps[wave]

    def computed(self) -> None:
        if self.copy is not None:
            event = torch.cuda.Event()
            event.record(self.compute)
            self.done.append(event)

    def drain(self) -> None:
        """After a failure: later work must not overtake page-ins already issued."""
        if self.copy is not None:
            self.compute.wait_stream(self.copy)
