"""The paging state of one layer, whatever framework runs its experts.

``LayerPager`` owns what every integration shares: the store's rows and slots of the layer, the
residency shared by the host and device planners, the counters, and the two ways a step makes its
experts resident: ``host_waves`` (plan on the host, page each wave in through the copy engine,
run it) and ``device_slots`` (plan and gather on the device, no host sync: capturable). An
integration subclasses it and adds only how its experts run over slot ids and how its outputs are
reduced (``executor.PagedLayer`` for HF-style modules, the SGLang plugin's ``PagedExperts``).
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Sequence

import torch

from .device_residency import DeviceResidency, SharedResidency
from .errors import ConfigError, PageInError, VerifyError
from .residency import Residency, Wave, plan_waves
from .store import DeviceGatherStore, PagedExpertStore, RowSpec, layer_row_bytes
from .telemetry import COUNTED, LayerStats, PagingTimer

logger = logging.getLogger("moepage")


class LayerPager:
    """Rows, slots, residency and counters of one paged layer.

    ``device_planner``: decide steps of at most K entries on the device (needs a store that can
    gather there). None: on for CUDA slots when the store can, off elsewhere.
    """

    def __init__(
        self,
        name: str,
        store: PagedExpertStore,
        specs: dict[str, RowSpec],
        num_experts: int,
        num_slots: int,
        verify: bool = False,
        device_planner: bool | None = None,
        overlap: bool = False,
    ):
        self.name = name
        self.overlap = overlap and num_slots >= 2  # multi-wave page-in overlapped with compute
        self._copy_stream: torch.cuda.Stream | None = None
        self.store = store
        self.specs = specs
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.verify = verify
        self.row_bytes = layer_row_bytes(specs)
        self.device = device = store.slots(name, next(iter(specs))).device
        can = isinstance(store, DeviceGatherStore) and store.can_gather(device)
        if device_planner and not can:
            raise ConfigError(
                f"layer {name}: device_planner=True but the {store.name} store cannot gather a "
                f"device-made plan into slots on {device}"
            )
        use = can and (device_planner if device_planner is not None else device.type == "cuda")
        state = DeviceResidency(num_experts, num_slots, device) if use else None
        self.shared = SharedResidency(Residency(num_experts, num_slots), state)
        self.host_stats = LayerStats()
        self.timer = PagingTimer(device)
        # Opt-in periodic log line: MOEPAGE_LOG_EVERY=N logs this layer's counters every N steps.
        self.log_every = int(os.environ.get("MOEPAGE_LOG_EVERY", "0") or 0)
        self._steps_seen = 0  # host-side count of all steps: no device read per step

    @property
    def residency(self) -> Residency:
        """The host residency, brought up to date if the device planner ran last."""
        return self.shared.for_host()

    @property
    def stats(self) -> LayerStats:
        """Host-planned counters plus the device-planned ones (read from the device now)."""
        out = LayerStats(*(getattr(self.host_stats, f) for f in COUNTED), self.timer.seconds())
        if self.shared.device is not None:
            steps, hits, misses = self.shared.device.counters.tolist()
            out += LayerStats(steps, steps, hits, misses, misses * self.row_bytes)
        return out

    def _stepped(self) -> None:
        self._steps_seen += 1
        if self.log_every and self._steps_seen % self.log_every == 0 and not _capturing():
            logger.info("moepage: layer %s: %s", self.name, self.stats.line())

    # -- which planner -------------------------------------------------------------------------
    def fits_device_plan(self, entries: int) -> bool:
        """Whether a step of ``entries`` routed entries is planned on the device (shapes only)."""
        return self.shared.device is not None and entries <= self.num_slots

    def plans_on_device(self, tokens: int, top_k: int, on_cuda: bool) -> bool:
        """Whether a step of ``tokens`` x ``top_k`` routed entries is planned on the device.
        Decided from shapes alone, so a captured graph always takes the same path; a captured
        step that does not fit raises here rather than compute garbage."""
        if self.fits_device_plan(tokens * top_k):
            return True
        if on_cuda and torch.cuda.is_current_stream_capturing():
            raise ConfigError(
                f"layer {self.name}: a captured step routes {tokens} tokens x top_k {top_k} = "
                f"{tokens * top_k} entries, more than the K={self.num_slots} slots a device-planned "
                f"step can serve; capture batches of at most {self.num_slots // top_k} tokens"
            )
        return False

    # -- device-planned step -------------------------------------------------------------------
    def device_slots(self, ids: torch.Tensor, pad: int, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Plan and page in one wave on the device; the slot of every routed entry of ``ids``
        (padding entries, where ``valid`` is False, get ``pad``). No host sync."""
        state = self.shared.for_device()
        state.plan(ids)
        self.store.gather(self.name, state.plan_experts, state.plan_slots, state.plan_count)  # type: ignore[attr-defined]
        if valid is None:
            valid = (ids >= 0) & (ids < self.num_experts)
        slots = torch.where(valid, state.expert_slot[ids.clamp(0, self.num_experts - 1).long()].long(), pad)
        if self.verify:
            self.check_slots()
        self._stepped()
        return slots

    # -- host-planned step ---------------------------------------------------------------------
    def host_waves(self, distinct: Sequence[int], run_wave: Callable[[Wave, torch.Tensor, int], None]) -> int:
        """Plan ``distinct`` into waves on the host state, page each wave in and call
        ``run_wave(wave, to_slot, number_of_waves)``, ``to_slot`` ``[E + 1]`` on the slots' device:
        the slot of each expert of the wave, -1 elsewhere (index E: padding). Returns the number
        of waves. If anything raises, the slots of the waves whose page-in did not complete are
        forgotten: the next step is exact.

        With ``overlap``, a step of more than K experts runs in waves of at most K // 2, so wave
        i+1's page-in never targets a slot of wave i; it is issued before wave i runs (on CUDA on
        a copy stream, ordered by events), so the copy of one wave overlaps the computation of the
        one before."""
        # A step that fits K runs as one wave: splitting it would only add a wave's overhead.
        split = self.overlap and len(distinct) > self.num_slots
        waves = plan_waves(self.shared.for_host(), distinct, self.num_slots // 2 if split else None)
        self.host_stats.steps += 1
        pipe = _CopyPipeline(self, overlapped=split)
        ahead = 1 if split else 0  # waves whose page-in is issued before the running one computes
        try:
            for i, wave in enumerate(waves):
                while pipe.issued <= min(i + ahead, len(waves) - 1):
                    pipe.issue(waves[pipe.issued])
                to_slot = pipe.ready(i)
                self.host_stats.waves += 1
                self.host_stats.hits += wave.hits
                run_wave(wave, to_slot, len(waves))
                pipe.computed()
        except BaseException:
            # plan_waves placed every wave up front: the slots of waves not yet paged in do not
            # hold what the residency says.
            self.shared.for_host().invalidate(s for w in waves[pipe.issued :] for _, s in w.loads)
            pipe.drain()
            raise
        self._stepped()
        return len(waves)

    def copy_stream(self) -> torch.cuda.Stream:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        return self._copy_stream

    def slot_map(self, wave: Wave) -> torch.Tensor:
        """``[E + 1]`` on the host: the slot of each expert of ``wave``, -1 elsewhere (index E:
        padding)."""
        to_slot = torch.full((self.num_experts + 1,), -1, dtype=torch.long, device="cpu")
        to_slot[list(wave.experts)] = torch.tensor(wave.slots, dtype=torch.long, device="cpu")
        return to_slot

    def _page_in(self, loads: Sequence[tuple[int, int]]) -> None:
        if not loads:
            return
        try:
            with self.timer.span():
                self.store.page_in(self.name, loads)
        except Exception as exc:
            # The targeted slots hold unknown contents now: forget them.
            self.shared.for_host().invalidate(s for _, s in loads)
            if isinstance(exc, PageInError):
                raise
            raise PageInError(f"layer {self.name}: page-in of {len(loads)} experts failed: {exc}") from exc
        self.host_stats.misses += len(loads)
        self.host_stats.bytes_paged += len(loads) * self.row_bytes
        if self.verify:
            # Against the loads, not the residency: plan_waves has already placed later waves.
            self._check_rows(loads)

    # -- verify --------------------------------------------------------------------------------
    def check_slots(self, slots: list[int] | None = None) -> None:
        """Raise ``VerifyError`` unless every given (default: every) resident slot equals its host row."""
        slot_expert = self.shared.for_host().slot_expert
        self._check_rows([(slot_expert[s], s) for s in (range(self.num_slots) if slots is None else slots)])

    def _check_rows(self, pairs: Sequence[tuple[int, int]]) -> None:
        for e, s in pairs:
            if e < 0:
                continue
            for name in self.specs:
                host = self.store.host_rows(self.name, name)[e]
                if not torch.equal(host, self.store.slots(self.name, name)[s].to(host.device)):
                    raise VerifyError(f"layer {self.name}: slot {s} of {name!r} differs from host row of expert {e}")


class _CopyPipeline:
    """Page-ins and slot maps of one host-planned step, in wave order. Overlapped on CUDA: each
    wave's slot map and rows go up on the layer's copy stream after the computation of the wave
    two before it (whose slots they may reuse), and each wave's computation waits for them.

    The slot map travels on the copy stream too: an upload from the compute stream would queue
    on the same copy engine behind the next wave's rows, and the wave would wait for them."""

    def __init__(self, pager: LayerPager, overlapped: bool):
        self.pager = pager
        self.cuda = overlapped and pager.timer.cuda
        self.issued = 0  # waves whose page-in completed (on the host side)
        self.maps: list[torch.Tensor] = []
        self.copied: list[torch.cuda.Event] = []
        self.done: list[torch.cuda.Event] = []
        if self.cuda:
            self.compute = torch.cuda.current_stream()
            self.copy = pager.copy_stream()
            self.copy.wait_stream(self.compute)  # earlier work on these slots comes first

    def issue(self, wave: Wave) -> None:
        to_slot = self.pager.slot_map(wave)
        if not self.cuda:
            self.pager._page_in(wave.loads)
            self.maps.append(to_slot.to(self.pager.device, non_blocking=True))
        else:
            if self.issued >= 2:
                self.copy.wait_event(self.done[self.issued - 2])
            # Allocated on the compute stream, which reads it; the copy stream has waited for
            # every computation enqueued before this point.
            on_device = torch.empty_like(to_slot, device=self.pager.device)
            with torch.cuda.stream(self.copy):
                on_device.copy_(to_slot.pin_memory(), non_blocking=True)
                self.pager._page_in(wave.loads)
                event = torch.cuda.Event()
                event.record(self.copy)
            self.maps.append(on_device)
            self.copied.append(event)
        self.issued += 1

    def ready(self, wave: int) -> torch.Tensor:
        """The slot map of ``wave``, once the compute stream may use it and the wave's rows."""
        if self.cuda:
            self.compute.wait_event(self.copied[wave])
        return self.maps[wave]

    def computed(self) -> None:
        if self.cuda:
            event = torch.cuda.Event()
            event.record(self.compute)
            self.done.append(event)

    def drain(self) -> None:
        """After a failure: later work must not overtake page-ins already issued."""
        if self.cuda:
            self.compute.wait_stream(self.copy)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
