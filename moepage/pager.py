"""The paging state of one layer, whatever framework runs its experts.

``LayerPager`` owns the layer's rows and slots in the store, its one residency state (on the
device where the device planner runs; the host ``Residency`` is then a scratch copy), its
counters, a pending prefetch (awaited by every reader of the slots or the state), in-place edits
after wrap, verify, and the operations ``moepage.step`` composes. Reads that synchronise say so:
``read_residency``, ``read_stats``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from . import capture
from .backends.protocol import PagedExpertStore, RowSpec, layer_row_bytes
from .bits import same_bits
from .config import PagingConfig, device_planner_problem, use_device_planner
from .device_state import DeviceResidency, PlanBuffers
from .errors import ConfigError, PageInError, VerifyError
from .pipeline import CopyPipeline, WaveStreams
from .residency import Residency, Wave, plan_waves, prefetch_wave
from .telemetry import COUNTED, LayerStats, PagingTimer, StepLog, with_device_counters


def can_plan_on_device(store: PagedExpertStore, device: torch.device) -> bool:
    """Whether ``store`` can page a device-made plan into slots on ``device``."""
    return store.can_gather(device)


class LayerPager:
    """Rows, slots, residency, counters and page-ins of one paged layer."""

    def __init__(self, name: str, store: PagedExpertStore, specs: dict[str, RowSpec], num_experts: int,
                 num_slots: int, config: PagingConfig | None = None):
        self.name, self.store, self.specs = name, store, specs
        self.num_experts, self.num_slots = num_experts, num_slots
        self.config = config = config or PagingConfig()
        self.row_bytes = layer_row_bytes(specs)
        self.device = device = store.slots(name, next(iter(specs))).device
        can = can_plan_on_device(store, device)
        if why := device_planner_problem(config.device_planner, can, store.name, device):
            raise ConfigError(f"layer {name}: {why}")
        self.host = Residency(num_experts, num_slots, config.policy)
        self.device_state = DeviceResidency(self.host, device) if use_device_planner(
            config.device_planner, can, device.type) else None
        self.host_stats = LayerStats()
        self.timer = PagingTimer(device)
        self.log = StepLog(name, config.log_every)
        self._copy_stream: torch.cuda.Stream | None = None
        self._pending: tuple[torch.cuda.Event, bool] | None = None  # a prefetch's page-in, and whether captured
        self.released = False  # unwrapped: its rows and slots are gone (a predecessor's prefetch skips it)
        self._seen: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self.writing = False  # slots or state changed and not yet recorded (``settle``)
        self.mark_written()

    # -- which planner -----------------------------------------------------------------------------
    def plans_on_device(self, entries: int) -> bool:
        """On the device: a step of at most K entries, and any step under capture (a replay runs no
        Python) or ``capture_mode``; a larger eager step on the host (the copy engine pages it)."""
        if self.device_state is None:
            if capture.in_capture_mode():
                why = "a CUDA graph is being captured" if capture.capturing() else "moepage.capture_mode() is on"
                raise ConfigError(
                    f"layer {self.name}: {why}, but this layer plans its steps on the host "
                    f"(the {self.store.name} store, device_planner={self.config.device_planner}); capture_mode plans "
                    "every step on the device: wrap with device_planner=True (the cuda backend on CUDA, torch on "
                    "the CPU)"
                )
            return False
        return entries <= self.num_slots or capture.in_capture_mode()

    def device_wave_width(self, entries: int) -> int:
        """The experts a wave of a device-planned step of ``entries`` routed entries takes: K, or K // 2 where
        ``decode_overlap`` pages each wave in beside the previous one's computation (a step of more than K)."""
        k = self.num_slots
        overlapped = self.config.decode_overlap and k >= 2 and min(self.num_experts, entries) > k
        return k // 2 if overlapped else k

    def device_wave_count(self, entries: int) -> int:
        """Waves of a device-planned step of ``entries`` routed entries: fixed by shapes alone."""
        return max(1, math.ceil(min(self.num_experts, entries) / self.device_wave_width(entries)))

    def _device(self) -> DeviceResidency:
        if self.device_state is None:
            raise ConfigError(f"layer {self.name}: device-planned steps need the device planner")
        return self.device_state

    # -- device-planned waves (no host sync) -------------------------------------------------------
    def device_ranks(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The wave order of a device-planned step of several waves (None for one wave)."""
        return self._device().ranks(ids) if self.device_wave_count(ids.numel()) > 1 else None

    def plan_device_wave(self, ids: torch.Tensor, pad: int, ranks: torch.Tensor | None, wave: int,
                         out: torch.Tensor | None = None) -> torch.Tensor:
        """Place wave ``wave`` of the step ``ids`` on the device; every entry's slot (``pad`` for
        padding and for the entries of other waves), in ``out`` if given."""
        self.begin_write()  # the state names the wave's experts before the gather copies them
        return self._device().plan(ids, pad, ranks, wave, self.device_wave_width(ids.numel()), out)

    def gather(self, plan: PlanBuffers | None = None, background: bool = False,
               side: torch.cuda.Stream | None = None) -> None:
        """Page in the step's plan (or a prefetch's, ``background``: on the store's background grid), on stream
        ``side`` if given. Eager, a failed gather forgets the planned slots (the state already names their new
        experts)."""
        state = self._device()
        plan = state.step_plan if plan is None else plan
        extra = {"background": True} if background else {}  # stores written before prefetch work
        self.begin_write()
        try:
            with torch.cuda.stream(side) if side is not None else nullcontext():
                self.store.gather(self.name, plan.experts, plan.slots, plan.count, **extra)  # type: ignore[attr-defined]
        except BaseException as exc:  # Ctrl-C too: the slots are torn either way
            if capture.capturing():  # the capture fails as a whole; nothing has run
                raise
            count = int(plan.count)
            state.pull(self.host)
            self.host.invalidate(plan.slots[:count].tolist())
            state.push(self.host)
            self.end_write()
            if not isinstance(exc, Exception):
                raise
            what = "page-in" if plan is state.step_plan else "prefetch"
            raise PageInError(f"layer {self.name}: device {what} of {count} experts failed: {exc}") from exc
        self.end_write()  # host-side bookkeeping: also while a graph is captured

    # -- host-planned waves ------------------------------------------------------------------------
    def read_state(self, ids: torch.Tensor) -> list[int]:
        """Bring ``host`` up to date and return the step's distinct valid experts (one sync)."""
        if self.device_state is not None:
            return self.device_state.pull(self.host, ids)
        valid = (ids >= 0) & (ids < self.num_experts)
        return torch.unique(ids[valid]).tolist()

    def wave_size(self, distinct: int) -> int | None:
        """A host-planned step's wave size: K (None), or with ``overlap`` half the room admission
        leaves, so no wave's page-in reuses the slots of the wave computing beside it."""
        room = min(self.config.admit or self.num_slots, self.num_slots)
        split = self.config.overlap and distinct > self.num_slots and room >= 2
        return room // 2 if split else None

    def place_waves(self, distinct: list[int], wave_size: int | None) -> list[Wave]:
        """Place a host-planned step's waves and count the step (a failure leaves the state as it was)."""
        before = self.host.table()
        self.begin_write()  # until the step writes its state back (``step.host_step``)
        try:
            waves = plan_waves(self.host, distinct, wave_size, admit=self.config.admit)
        except BaseException:
            self.host.load_table(before)  # nothing was paged: the step never happened
            self.end_write()
            raise
        self.host_stats.steps += 1
        return waves

    def copy_pipeline(self, overlapped: bool) -> CopyPipeline:
        """The page-ins of a host-planned step: on a copy stream when ``overlapped`` (CUDA)."""
        return CopyPipeline(self.page_in, self.slot_map, self.device, self.wave_streams(overlapped))

    def wave_streams(self, overlapped: bool = True) -> WaveStreams:
        """A step's streams: with ``overlapped``, the copy stream beside the step's (CUDA); else one stream."""
        on_copy = overlapped and self.device.type == "cuda"
        return WaveStreams(self.device, self.copy_stream() if on_copy else None)

    def count_wave(self, wave: Wave) -> None:
        self.host_stats.waves += 1
        self.host_stats.hits += wave.hits

    def abandon(self, waves: Sequence[Wave]) -> None:
        """After a failure: the slots of waves placed but not paged in hold other experts."""
        self.host.invalidate(s for w in waves for _, s in w.loads)

    def write_state(self) -> None:
        """A host-planned step's result back into the device state (in stream order)."""
        if self.device_state is not None:
            self.device_state.push(self.host)

    def slot_map(self, wave: Wave) -> torch.Tensor:
        """``[E + 1]`` on the host: the slot of each expert of ``wave``, -1 elsewhere (E: padding)."""
        to_slot = torch.full((self.num_experts + 1,), -1, dtype=torch.long, device="cpu")
        to_slot[list(wave.experts)] = torch.tensor(wave.slots, dtype=torch.long, device="cpu")
        return to_slot

    def page_in(self, loads: Sequence[tuple[int, int]], prefetch: bool = False) -> None:
        """Copy ``loads`` ((expert, slot) pairs) in and count them (misses, or ``prefetched``); on
        failure forget their slots and raise ``PageInError``."""
        if not loads:
            return
        self.begin_write()  # cleared by the step (or prefetch) that placed them, once its state is written back
        try:
            with self.timer.span():
                self.store.page_in(self.name, loads)
        except BaseException as exc:  # Ctrl-C too: the slots are torn either way
            self.host.invalidate(s for _, s in loads)  # their contents are unknown now
            self.mark_written()
            if isinstance(exc, PageInError) or not isinstance(exc, Exception):
                raise
            raise PageInError(f"layer {self.name}: page-in of {len(loads)} experts failed: {exc}") from exc
        stats = self.host_stats
        if prefetch:
            stats.prefetched += len(loads)
        else:
            stats.misses += len(loads)
        stats.bytes_paged += len(loads) * self.row_bytes
        self.mark_written()
        if self.config.verify:  # against the loads: later waves are placed already
            self._check_rows(loads)

    def copy_stream(self) -> torch.cuda.Stream:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        return self._copy_stream

    def finish_step(self) -> None:
        """After every step: verify (eager) and the periodic log line."""
        if capture.capturing():
            return
        if self.config.verify:
            self.check_slots()
        self.log.stepped(self.read_stats)

    # -- prefetch ----------------------------------------------------------------------------------
    def prefetch(self, ids: torch.Tensor) -> None:
        """Page in the experts predicted for the next step (``ids``, any shape; invalid ids ignored)
        as one wave of at most K by the policy's rule, counted as ``prefetched``. Device state:
        planned on the current stream, gathered on the side stream (no host sync). Host state:
        paged in at once."""
        if self.device_state is None and capture.capturing():
            raise ConfigError(
                f"layer {self.name}: a prefetch inside a CUDA graph capture needs the device planner "
                f"(the {self.store.name} store, device_planner={self.config.device_planner} plans on the host)"
            )
        self.settle()
        self.await_prefetch()  # the previous one still reads the plan buffers this one overwrites
        ids = ids.to(self.device)
        state = self.device_state
        self.begin_write()  # the plan changes the state before its rows are in (the gather or page-in ends it)
        if state is None:
            self.page_in(prefetch_wave(self.host, self.read_state(ids)).loads, prefetch=True)
            self.end_write()
        elif self.device.type != "cuda":
            state.plan_prefetch(ids)
            self.gather(state.prefetch_plan, background=True)
        else:
            state.plan_prefetch(ids)  # on the current stream: the table stays in order with every step
            side = self.copy_stream()
            side.wait_stream(torch.cuda.current_stream(self.device))  # the slots' readers, the plan, the step's page-in
            self.gather(state.prefetch_plan, background=True, side=side)
            event = torch.cuda.Event()
            event.record(side)
            self._pending = (event, torch.cuda.is_current_stream_capturing())
        if self.config.verify and not capture.capturing():
            self.check_slots()

    def await_prefetch(self) -> None:
        """Order the current stream after a pending prefetch (no host sync). An event recorded
        before a capture began is not waited for inside it: the capture's start synchronised it."""
        if self._pending is None:
            return
        event, captured = self._pending
        if captured or not capture.capturing():
            torch.cuda.current_stream(self.device).wait_event(event)
        self._pending = None

    # -- reads that synchronise ----------------------------------------------------------------------
    def read_residency(self) -> Residency:
        """The layer's residency as of now (read from the device where it lives there: a sync)."""
        self.settle()
        self.await_prefetch()
        if self.device_state is not None:
            self.device_state.pull(self.host)
        return self.host

    def read_stats(self) -> LayerStats:
        """Host-planned counters plus the device-planned ones (read from the device: a sync)."""
        out = LayerStats(**{f: getattr(self.host_stats, f) for f in COUNTED}, paging_seconds=self.timer.seconds(),
                         num_slots=self.num_slots)
        if self.device_state is None:
            return out
        step, ahead = (p.counters.tolist() for p in self.device_state.plans())
        return with_device_counters(out, step, ahead, self.row_bytes)

    # -- edits made in place after wrap --------------------------------------------------------------
    def _versions(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        # torch bumps a tensor's version on in-place writes through torch, not through raw pointers.
        store, name = self.store, self.name
        return (tuple(store.rows_version(name, n) for n in self.specs),
                tuple(store.slots(name, n)._version for n in self.specs))

    def mark_written(self) -> None:
        """Record the rows and slots as moepage itself left them (after each of its writes)."""
        self._seen = self._versions()

    # -- interrupted writes --------------------------------------------------------------------------
    # ``writing`` is set before moepage changes slots or the residency state and cleared once the two agree again
    # (also after a failure's own repair). An interrupt (Ctrl-C lands between any two lines) that leaves it set means
    # no slot's contents are known: ``settle`` forgets them all before the next step, so each pages in again.
    def begin_write(self) -> None:
        self.writing = True

    def end_write(self) -> None:
        self.mark_written()
        self.writing = False

    def settle(self) -> None:
        """Before a step (and before slots are compared for edits): repair an interrupted write."""
        if not self.writing or capture.capturing():
            return
        if self.device_state is not None:
            self.device_state.pull(self.host)
        self.host.clear()
        if self.device_state is not None:
            self.device_state.push(self.host)
        self.end_write()

    def slot_edits(self) -> list[str]:
        """The paged tensors whose slots were written in place since moepage last wrote them."""
        self.settle()
        return [n for n, now, seen in zip(self.specs, self._versions()[1], self._seen[1]) if now != seen]

    def follow_edits(self) -> None:
        """Before an eager step: host rows written in place (``state_dict()`` entries) reach their
        resident slots; slots written in place (``parameters()``: K of the E rows) are refused."""
        self.settle()
        if edited := self.slot_edits():
            raise ConfigError(
                f"layer {self.name}: {', '.join(map(repr, edited))} (the slot table of the K={self.num_slots} "
                f"resident experts of {self.num_experts}, which model.parameters() shows) was written in place "
                "after wrap; the edit reaches only the resident experts and the next page-in undoes it. Edit the "
                "host rows instead (model.state_dict() entries hold every expert; in-place edits there are "
                "followed), or moepage.unwrap the model, edit it and wrap it again"
            )
        if self._versions()[0] != self._seen[0]:
            self.refresh_slots()

    def refresh_slots(self) -> None:
        """Copy every resident expert's host rows into its slot (after the host rows changed)."""
        slot_expert = self.read_residency().slot_expert
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no page-in still reads what we overwrite
        self.begin_write()
        with torch.no_grad():
            for name in self.specs:
                slots = self.store.slots(self.name, name)
                for slot, expert in enumerate(slot_expert):
                    if expert >= 0:
                        slots[slot].copy_(self.store.read_row(self.name, name, expert))
        self.end_write()

    # -- verify ----------------------------------------------------------------------------------------
    def check_slots(self, slots: list[int] | None = None) -> None:
        """Raise ``VerifyError`` unless every given (default: every) resident slot equals its host row."""
        slot_expert = self.read_residency().slot_expert
        self._check_rows([(slot_expert[s], s) for s in (range(self.num_slots) if slots is None else slots)])

    def _check_rows(self, pairs: Sequence[tuple[int, int]]) -> None:
        # Coded host rows are decoded here by the torch reference decoder, apart from the page-in's decode.
        for e, s in pairs:
            if e < 0:
                continue
            for name in self.specs:
                host = self.store.read_row(self.name, name, e)
                if not same_bits(host, self.store.slots(self.name, name)[s]):
                    raise VerifyError(f"layer {self.name}: slot {s} of {name!r} differs from host row of expert {e}")
