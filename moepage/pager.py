"""One paged layer's state, whatever framework runs its experts: its rows and slots in the store, its one residency
state, its counters, a pending prefetch, the edits made after wrap, and the primitive writes that keep the slots and
the state agreeing (``page_in`` and ``gather``, repaired on failure; ``settle`` after an interrupt). The algorithm of a
step is ``moepage.step``'s.

**One residency truth.** Where the device planner runs, the state lives on the device (``DeviceResidency``: one int64
table the planner kernels update in place, so graph replays keep it current) and the host's ``Residency``
(``LayerPager.residency``) is a scratch copy a host-planned step ``pull``s in the sync that reads its routing and
``push``es back in stream order with its page-ins. No second copy can go stale. Reads that synchronise say so:
``read_residency``, ``read_stats``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Protocol

import torch

from . import capture
from .backends.protocol import PagedExpertStore, RowSpec, layer_row_bytes
from .bits import same_bits
from .config import PagingConfig, device_planner_problem, use_device_planner
from .errors import ConfigError, PageInError, VerifyError
from .kernels.planner import PlanBuffers, PlannerState, plan_step, presence
from .kernels.ranks import step_ranks
from .residency import Residency
from .telemetry import COUNTED, LayerStats, PagingTimer, StepLog, with_device_counters


def can_plan_on_device(store: PagedExpertStore, device: torch.device) -> bool:
    """Whether ``store`` can page a device-made plan into slots on ``device``."""
    return store.can_gather(device)


class DeviceResidency:
    """A layer's residency on the device: ``Residency``'s arrays in one int64 ``table``, the planner's view of them,
    and plan buffers for steps and for prefetches (apart, so step counters stay critical-path figures)."""

    def __init__(self, residency: Residency, device: torch.device):
        k, e = residency.num_slots, residency.num_experts
        self.num_slots, self.num_experts = k, e
        self.table = torch.tensor(residency.table(), dtype=torch.int64, device=device)
        self.slot_expert = self.table[:k]
        self.expert_slot = self.table[k : k + e]
        self.last_use = self.table[k + e : 2 * k + e]
        self.clock = self.table[2 * k + e : 2 * k + e + 1]
        self.score = self.table[2 * k + e + 1 :]
        self.state = PlannerState(self.slot_expert, self.expert_slot, self.last_use, self.clock, self.score,
                                  residency.policy)
        self.step_plan = PlanBuffers.new(k, device)
        self.prefetch_plan = PlanBuffers.new(k, device)
        self.counters = self.step_plan.counters  # steps, waves, hits, misses of device-planned steps

    def plans(self) -> tuple[PlanBuffers, PlanBuffers]:
        """The steps' and the prefetches' plan buffers."""
        return self.step_plan, self.prefetch_plan

    def pull(self, residency: Residency, ids: torch.Tensor | None = None) -> list[int]:
        """Load the state into ``residency`` (the host's copy) and return ``ids``' distinct valid experts: one
        device-to-host copy."""
        parts = [self.table]
        if ids is not None:
            parts.append(presence(ids, self.num_experts, self.table.device)[1].long())
        values = torch.cat(parts).tolist()
        n = self.table.numel()
        residency.load_table(values[:n])
        return [x for x, present in enumerate(values[n:]) if present]

    def push(self, residency: Residency) -> None:
        """Write ``residency``'s state back after the current stream's queued work (staged: ``residency`` may
        change)."""
        self.table.copy_(torch.tensor(residency.table(), dtype=torch.int64, device="cpu"), non_blocking=True)

    def ranks(self, ids: torch.Tensor) -> torch.Tensor:
        """Wave order of a step of more than K distinct experts (``kernels.ranks.step_ranks``)."""
        return step_ranks(ids, self.expert_slot)

    def plan(self, ids: torch.Tensor, pad: int, ranks: torch.Tensor | None = None, wave: int = 0,
             width: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Place one wave (of ``width`` experts, K by default) and write its plan; returns each entry's slot (``pad``:
        padding, other waves), in ``out`` if given."""
        if out is None:
            out = torch.empty(ids.shape, dtype=ids.dtype, device=ids.device)
        plan_step(ids, self.state, self.step_plan, out=out, pad=pad, ranks=ranks, wave=wave, width=width)
        return out

    def plan_prefetch(self, ids: torch.Tensor) -> None:
        """Place ``ids``' experts into ``prefetch_plan`` as wave 0 of a step of those ids would be."""
        if ids.numel() > self.num_experts:
            # Only the set of experts matters: plan E entries, not a prefill's T x m (Triton loads all in one program).
            e = self.num_experts
            present = presence(ids, e, self.table.device)[1]
            ids = torch.where(present, torch.arange(e, device=self.table.device), -1)
        ranks = self.ranks(ids) if min(self.num_experts, ids.numel()) > self.num_slots else None
        plan_step(ids, self.state, self.prefetch_plan, ranks=ranks)


class StepSplit(Protocol):
    """What a step asks of its layer's CPU share (``split.Split``): the share of one step, or None (no split)."""

    def begin(self, layer: LayerPager, ids: torch.Tensor, distinct: list[int], computation: object): ...


class LayerPager:
    """Rows, slots, residency, counters and the primitive page-ins of one paged layer."""

    def __init__(self, name: str, store: PagedExpertStore, specs: dict[str, RowSpec], num_experts: int,
                 num_slots: int, config: PagingConfig | None = None, split: StepSplit | None = None):
        self.name, self.store, self.specs = name, store, specs
        self.num_experts, self.num_slots = num_experts, num_slots
        self.config = config = config or PagingConfig()
        self.row_bytes = layer_row_bytes(specs)
        self.device = device = store.slots(name, next(iter(specs))).device
        can = can_plan_on_device(store, device)
        if why := device_planner_problem(config.device_planner, can, store.name, device):
            raise ConfigError(f"layer {name}: {why}")
        self.residency = Residency(num_experts, num_slots, config.policy)
        self.device_state = DeviceResidency(self.residency, device) if use_device_planner(
            config.device_planner, can, device.type) else None
        self.counts = LayerStats()  # of host-planned steps and page-ins (the device state counts its own)
        # cpu_share: each eager step's CPU share (a ``split.Split``, made by ``lifetime.page_layer``); None, the
        # default, adds no work to a step
        self.split = split
        self.timer = PagingTimer(device)
        self.log = StepLog(name, config.log_every)
        self._copy_stream: torch.cuda.Stream | None = None
        self._pending: tuple[torch.cuda.Event, bool] | None = None  # a prefetch's page-in, and whether captured
        self.released = False  # unwrapped: its rows and slots are gone (a predecessor's prefetch skips it)
        self._seen: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self.writing = False  # slots or state changed and not yet recorded (``settle``)
        self.mark_written()

    def require_device_state(self) -> DeviceResidency:
        if self.device_state is None:
            raise ConfigError(f"layer {self.name}: device-planned steps need the device planner")
        return self.device_state

    # -- the state on the host side ------------------------------------------------------------------
    def read_state(self, ids: torch.Tensor) -> list[int]:
        """Bring ``residency`` up to date and return the step's distinct valid experts (one sync)."""
        if self.device_state is not None:
            return self.device_state.pull(self.residency, ids)
        valid = (ids >= 0) & (ids < self.num_experts)
        return torch.unique(ids[valid]).tolist()

    def write_state(self) -> None:
        """A host-planned step's result back into the device state (in stream order)."""
        if self.device_state is not None:
            self.device_state.push(self.residency)

    # -- the primitive writes: slots and state agree afterwards, or the slots are forgotten ------------------
    def page_in(self, loads: Sequence[tuple[int, int]], prefetch: bool = False) -> None:
        """Copy ``loads`` ((expert, slot) pairs) in and count them (misses, or ``prefetched``); on failure forget
        their slots and raise ``PageInError`` (an interrupt stays an interrupt)."""
        if not loads:
            return
        self.begin_write()  # cleared by the step (or prefetch) that placed them, once its state is written back
        try:
            with self.timer.span():
                self.store.page_in(self.name, loads)
        except BaseException as exc:  # Ctrl-C too: the slots are torn either way
            self.residency.invalidate(s for _, s in loads)  # their contents are unknown now
            self.mark_written()
            if isinstance(exc, PageInError) or not isinstance(exc, Exception):
                raise
            raise PageInError(f"layer {self.name}: page-in of {len(loads)} experts failed: {exc}") from exc
        counts = self.counts
        if prefetch:
            counts.prefetched += len(loads)
        else:
            counts.misses += len(loads)
        counts.bytes_paged += len(loads) * self.row_bytes
        self.mark_written()
        if self.config.verify:  # against the loads: later waves are placed already
            self._check_rows(loads)

    def gather(self, plan: PlanBuffers | None = None, background: bool = False,
               side: torch.cuda.Stream | None = None) -> None:
        """Page in the step's device-made plan (or a prefetch's, ``background``: beside compute), on stream ``side``
        if given. Eager, a failed gather forgets the planned slots (the state already names their new experts)."""
        state = self.require_device_state()
        plan = state.step_plan if plan is None else plan
        self.begin_write()
        try:
            with torch.cuda.stream(side) if side is not None else nullcontext():
                self.store.gather(self.name, plan.experts, plan.slots, plan.count, background=background)
        except BaseException as exc:  # Ctrl-C too: the slots are torn either way
            if capture.capturing():  # the capture fails as a whole; nothing has run
                raise
            count = int(plan.count)
            state.pull(self.residency)
            self.residency.invalidate(plan.slots[:count].tolist())
            state.push(self.residency)
            self.end_write()
            if not isinstance(exc, Exception):
                raise
            what = "page-in" if plan is state.step_plan else "prefetch"
            raise PageInError(f"layer {self.name}: device {what} of {count} experts failed: {exc}") from exc
        self.end_write()  # host-side bookkeeping: also while a graph is captured

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
            self.device_state.pull(self.residency)
        self.residency.clear()
        if self.device_state is not None:
            self.device_state.push(self.residency)
        self.end_write()

    # -- streams -----------------------------------------------------------------------------------------
    def copy_stream(self) -> torch.cuda.Stream:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        return self._copy_stream

    def pending_after(self, side: torch.cuda.Stream) -> None:
        """A prefetch's page-in was queued on ``side``: the next reader of the slots or the state waits for it."""
        event = torch.cuda.Event()
        event.record(side)
        self._pending = (event, torch.cuda.is_current_stream_capturing())

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
            self.device_state.pull(self.residency)
        return self.residency

    def read_stats(self) -> LayerStats:
        """Host-planned counters plus the device-planned ones (read from the device: a sync)."""
        out = LayerStats(**{f: getattr(self.counts, f) for f in COUNTED}, paging_seconds=self.timer.seconds(),
                         num_slots=self.num_slots) + self.store.tier_stats(self.name)
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
