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
        device = store.slots(name, next(iter(specs))).device
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
    def host_waves(self, distinct: Sequence[int], run_wave: Callable[[Wave, int], None]) -> int:
        """Plan ``distinct`` into waves on the host state, page each wave in and call
        ``run_wave(wave, number_of_waves)``; returns the number of waves. If anything raises, the
        slots of the waves whose page-in did not complete are forgotten: the next step is exact.

        With ``overlap``, waves hold at most K // 2 experts, so wave i+1's page-in never targets a
        slot of wave i; it is issued before wave i runs (on CUDA on a copy stream, ordered by
        events), so the copy of one wave overlaps the computation of the one before."""
        waves = plan_waves(self.shared.for_host(), distinct, self.num_slots // 2 if self.overlap else None)
        self.host_stats.steps += 1
        pipe = _CopyPipeline(self, overlapped=self.overlap and len(waves) > 1)
        try:
            if waves:
                pipe.issue(waves[0].loads)
            for i, wave in enumerate(waves):
                if pipe.overlapped and i + 1 < len(waves):
                    pipe.issue(waves[i + 1].loads)
                elif i > 0:
                    pipe.issue(wave.loads)
                pipe.wait_copy(i)
                self.host_stats.waves += 1
                self.host_stats.hits += wave.hits
                run_wave(wave, len(waves))
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
            self._copy_stream = torch.cuda.Stream(device=self.store.slots(self.name, next(iter(self.specs))).device)
        return self._copy_stream

    def slot_map(self, wave: Wave, device: torch.device) -> torch.Tensor:
        """``[E + 1]``: the slot of each expert of ``wave``, -1 elsewhere (index E: padding)."""
        to_slot = torch.full((self.num_experts + 1,), -1, dtype=torch.long)
        to_slot[list(wave.experts)] = torch.tensor(wave.slots, dtype=torch.long)
        return to_slot.to(device, non_blocking=True)

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
    """Page-ins of one host-planned step, in wave order. Overlapped on CUDA: each page-in runs on
    the layer's copy stream after the computation of the wave two before it (whose slots it may
    reuse), and each wave's computation waits for its own page-in."""

    def __init__(self, pager: LayerPager, overlapped: bool):
        self.pager = pager
        self.overlapped = overlapped
        self.cuda = overlapped and pager.timer.cuda
        self.issued = 0  # waves whose page-in completed (on the host side)
        self.copied: list[torch.cuda.Event] = []
        self.done: list[torch.cuda.Event] = []
        if self.cuda:
            self.compute = torch.cuda.current_stream()
            self.copy = pager.copy_stream()
            self.copy.wait_stream(self.compute)  # earlier work on these slots comes first

    def issue(self, loads: Sequence[tuple[int, int]]) -> None:
        if not self.cuda:
            self.pager._page_in(loads)
        else:
            if self.issued >= 2:
                self.copy.wait_event(self.done[self.issued - 2])
            with torch.cuda.stream(self.copy):
                self.pager._page_in(loads)
                event = torch.cuda.Event()
                event.record(self.copy)
            self.copied.append(event)
        self.issued += 1

    def wait_copy(self, wave: int) -> None:
        if self.cuda:
            self.compute.wait_event(self.copied[wave])

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
