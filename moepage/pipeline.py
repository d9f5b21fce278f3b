"""The page-ins of one host-planned step, issued in wave order, optionally ahead of the
computation (``prefill_overlap``).

``CopyPipeline`` knows nothing of residency: it is handed the layer's ``page_in`` and
``slot_map`` and calls them wave by wave. Serialized (the default, and any non-CUDA device), a
wave's rows are copied on the compute stream just before the wave runs. Overlapped on CUDA, each
wave's slot map and rows go up on a copy stream after the computation of the wave two before it
(whose slots they may reuse: waves of at most K // 2 never reuse the previous wave's), and each
wave's computation waits for them with an event.

The slot map travels on the copy stream too: an upload from the compute stream would queue on the
same copy engine behind the next wave's rows, and the wave would wait for them.
"""

from __future__ import annotations

from typing import Callable, Sequence

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
            # Allocated on the compute stream, which reads it; the copy stream has waited for
            # every computation enqueued before this point.
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
