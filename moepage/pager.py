"""The paging state of one layer, whatever framework runs its experts.

``LayerPager`` owns what every integration shares: the store's rows and slots of the layer, its
one residency state, the counters, and the two ways a step makes its experts resident, each a loop
over waves that calls back the integration's ``run_wave``:

- ``host_waves``: plan on the host (reading the state first where a device state exists, writing
  it back after), page each wave in through the copy engine, run it;
- ``device_waves``: plan and gather on the device, no host sync: one wave for a step of at most K
  routed entries, ⌈min(E, entries) / K⌉ fixed by the shapes for a larger one. This is what a CUDA
  graph captures; it reads and writes only device state, so replays and eager steps interleave.

Both take an optional ``after_page_in`` hook, called once per step after the first wave's page-in
is issued and before that wave computes: where a step issues the next layer's prefetch
(``prefetch``). A pager's own ``prefetch`` (``prefetch.Prefetcher``) pages predicted experts in
ahead of its next step; every reader of its slots or state waits for a pending one first.

Integrations compose a pager (``executor.PagedLayer`` for HF-style modules, the SGLang plugin's
``PagedExperts``): they add how their experts run over slot ids and how outputs are reduced.
"""

from __future__ import annotations

import logging
import math
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from ._env import env_int
from .device_residency import COUNTERS, DeviceResidency, PlanBuffers
from .errors import ConfigError, PageInError, VerifyError
from .pipeline import CopyPipeline
from .prefetch import Prefetcher
from .residency import DEFAULT_POLICY, Policy, Residency, Wave, plan_waves
from .store import DeviceGatherStore, PagedExpertStore, RowSpec, layer_row_bytes
from .telemetry import COUNTED, LayerStats, PagingTimer

logger = logging.getLogger("moepage")

RunHostWave = Callable[[Wave, torch.Tensor, int], None]  # (wave, to_slot [E + 1], number of waves)
RunDeviceWave = Callable[[torch.Tensor, int, int], None]  # (entry slots, wave index, number of waves)
AfterPageIn = Callable[[], None]  # called once per step, after its first wave's page-in is issued


@dataclass(frozen=True)
class PagerOptions:
    """How a layer pages.

    - ``verify``: after every page-in, compare the slots with their host rows.
    - ``device_planner``: plan steps on the device (needs a store that can gather there). None:
      on for CUDA slots when the store can, off elsewhere.
    - ``overlap``: page wave i+1 of a multi-wave host-planned step in while wave i computes.
    - ``policy``: the eviction policy (``residency.Policy`` or its name).
    - ``admit``: prefill admission, the slots a host-planned step of more than K experts may
      evict into (``residency.plan_waves``); None: all.
    """

    verify: bool = False
    device_planner: bool | None = None
    overlap: bool = False
    policy: str | Policy = DEFAULT_POLICY
    admit: int | None = None


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_mode = threading.local()


@contextmanager
def capture_mode(enabled: bool = True) -> Iterator[None]:
    """Plan every step inside the block on the device, as a CUDA-graph capture does.

    Warm a step up under it before capturing it: a step of more than K routed entries is planned
    on the host when eager, and the device kernels it takes under capture compile on their first
    launch, which a capture cannot do. SGLang's graph runner turns it on by itself."""
    before = getattr(_mode, "device", False)
    _mode.device = before or enabled
    try:
        yield
    finally:
        _mode.device = before


def in_capture_mode() -> bool:
    return capturing() or getattr(_mode, "device", False)


def can_plan_on_device(store: PagedExpertStore, device: torch.device) -> bool:
    """Whether ``store`` can page a device-made plan into slots on ``device``."""
    return isinstance(store, DeviceGatherStore) and store.can_gather(device)


def wants_device_planner(store: PagedExpertStore, device: torch.device, asked: bool | None, name: str) -> bool:
    """The device-planner rule: ``asked`` (None: default on CUDA slots) where the store can; asking
    for it where it cannot is a ``ConfigError`` naming the layer."""
    can = can_plan_on_device(store, device)
    if asked and not can:
        raise ConfigError(
            f"layer {name}: device_planner=True but the {store.name} store cannot gather a device-made "
            f"plan into slots on {device} (use backend='cuda' on CUDA, or 'torch' on CPU)"
        )
    return can and (asked if asked is not None else device.type == "cuda")


class LayerPager:
    """Rows, slots, residency and counters of one paged layer."""

    def __init__(
        self,
        name: str,
        store: PagedExpertStore,
        specs: dict[str, RowSpec],
        num_experts: int,
        num_slots: int,
        options: PagerOptions = PagerOptions(),
    ):
        self.name = name
        self.store = store
        self.specs = specs
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.options = options
        self.row_bytes = layer_row_bytes(specs)
        self.device = device = store.slots(name, next(iter(specs))).device
        self.host = Residency(num_experts, num_slots, options.policy)
        use = wants_device_planner(store, device, options.device_planner, name)
        # Where the device planner runs, its arrays are the state; ``host`` is a scratch copy.
        self.device_state = DeviceResidency(self.host, device) if use else None
        self.host_stats = LayerStats()
        self.timer = PagingTimer(device)
        self._copy_stream: torch.cuda.Stream | None = None
        self.prefetcher = Prefetcher(self)
        self.released = False  # unwrapped: its rows and slots are gone (a predecessor's prefetch skips it)
        # Opt-in periodic log line: MOEPAGE_LOG_EVERY=N logs this layer's counters every N steps.
        self.log_every = env_int("MOEPAGE_LOG_EVERY", 0, minimum=0)
        self._steps_seen = 0  # host-side count of eager steps: no device read per step
        self._seen: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self.mark_written()

    @property
    def residency(self) -> Residency:
        """The layer's residency as of now (read from the device where the state lives there)."""
        self.await_prefetch()
        if self.device_state is not None:
            self.device_state.pull(self.host)
        return self.host

    @property
    def stats(self) -> LayerStats:
        """Host-planned counters plus the device-planned ones (read from the device now)."""
        out = LayerStats(**{f: getattr(self.host_stats, f) for f in COUNTED}, paging_seconds=self.timer.seconds())
        if self.device_state is not None:
            step, ahead = (dict(zip(COUNTERS, p.counters.tolist())) for p in self.device_state.plans())
            paged = step["misses"] + ahead["misses"]
            out += LayerStats(steps=step["steps"], waves=step["waves"], hits=step["hits"], misses=step["misses"],
                              prefetched=ahead["misses"], bytes_paged=paged * self.row_bytes)
        return out

    def _stepped(self) -> None:
        if capturing():
            return
        self._steps_seen += 1
        if self.log_every and self._steps_seen % self.log_every == 0:
            logger.info("layer %s: %s", self.name, self.stats.line())

    # -- which planner -------------------------------------------------------------------------
    def plans_on_device(self, entries: int) -> bool:
        """Whether a step of ``entries`` routed entries is planned on the device: always when it
        fits K (one wave), and any step while a CUDA graph is being captured (a replay runs no
        Python) or inside ``capture_mode``. Otherwise a larger step is planned on the host, where
        the copy engine pages it."""
        if self.device_state is None:
            if in_capture_mode():
                raise ConfigError(
                    f"layer {self.name}: a CUDA graph is being captured but this layer plans on the host "
                    f"(the {self.store.name} store, device_planner={self.options.device_planner}); "
                    "wrap with the cuda backend and the device planner to capture paged steps"
                )
            return False
        return entries <= self.num_slots or in_capture_mode()

    def device_wave_count(self, entries: int) -> int:
        """Waves of a device-planned step of ``entries`` routed entries: fixed by shapes alone."""
        return max(1, math.ceil(min(self.num_experts, entries) / self.num_slots))

    # -- device-planned step -------------------------------------------------------------------
    def device_waves(
        self, ids: torch.Tensor, pad: int, run_wave: RunDeviceWave, after_page_in: AfterPageIn | None = None
    ) -> int:
        """Plan, page in and run a step on the device, wave by wave, with no host sync. Each call
        ``run_wave(slots, w, n)`` gets every entry's slot (shaped like ``ids``), ``pad`` for
        padding and for the entries of other waves. Returns the number of waves."""
        state = self.device_state
        if state is None:
            raise ConfigError(f"layer {self.name}: device-planned steps need the device planner")
        self.await_prefetch()
        n = self.device_wave_count(ids.numel())
        ranks = state.ranks(ids) if n > 1 else None
        for w in range(n):
            slots = state.plan(ids, pad, ranks, w)
            self._gather(state.step_plan)
            if w == 0 and after_page_in is not None:
                after_page_in()
            run_wave(slots, w, n)
        if self.options.verify and not capturing():
            self.check_slots()
        self._stepped()
        return n

    def _gather(self, plan: PlanBuffers, background: bool = False, side: torch.cuda.Stream | None = None) -> None:
        """Page in the plan just made into ``plan`` (a prefetch: as a ``background`` copy, on the
        stream ``side`` where one is given). Eager, a failed gather forgets the planned slots (the
        state already says they hold their new experts), so the next step is exact."""
        # A step's gather is the protocol's original call: stores written before prefetch work.
        extra = {"background": True} if background else {}
        try:
            with torch.cuda.stream(side) if side is not None else nullcontext():
                self.store.gather(self.name, plan.experts, plan.slots, plan.count, **extra)  # type: ignore[attr-defined]
        except Exception as exc:
            if capturing():  # the capture fails as a whole; nothing has run
                raise
            state = self.device_state
            assert state is not None
            count = int(plan.count)
            state.pull(self.host)
            self.host.invalidate(plan.slots[:count].tolist())
            state.push(self.host)
            self.mark_written()
            what = "prefetch" if background else "page-in"
            raise PageInError(f"layer {self.name}: device {what} of {count} experts failed: {exc}") from exc
        if not capturing():
            self.mark_written()

    # -- prefetch ------------------------------------------------------------------------------
    def prefetch(self, ids: torch.Tensor) -> None:
        """Page the experts predicted for this layer's next step (``ids``, any shape; ids < 0 or
        >= E ignored) in ahead of it, as one wave of at most K by the policy's rule
        (``prefetch.Prefetcher``). Counted as ``prefetched``, never as the step's misses."""
        if self.device_state is None and capturing():
            raise ConfigError(
                f"layer {self.name}: a prefetch inside a CUDA graph capture needs the device planner "
                f"(the {self.store.name} store, device_planner={self.options.device_planner} plans on the host)"
            )
        self.prefetcher.prefetch(ids)
        if self.options.verify and not capturing():
            self.check_slots()

    def await_prefetch(self) -> None:
        """Order the current stream after a pending prefetch's page-in (no host sync)."""
        self.prefetcher.wait()

    def release(self) -> None:
        """Free the layer's rows and slots in the store (unwrap), after any pending prefetch."""
        self.await_prefetch()
        self.released = True
        self.store.release(self.name)

    # -- host-planned step ---------------------------------------------------------------------
    def host_waves(self, ids: torch.Tensor, run_wave: RunHostWave, after_page_in: AfterPageIn | None = None) -> int:
        """Plan the distinct valid experts of ``ids`` (ids < 0 or >= E are padding) into waves on
        the host, page each wave in and call ``run_wave(wave, to_slot, number_of_waves)``,
        ``to_slot`` ``[E + 1]`` on the slots' device: the slot of each expert of the wave, -1
        elsewhere (index E: padding). Returns the number of waves.

        The state is read first and written back before returning, also on failure; if anything
        raises, the slots of the waves whose page-in did not complete are forgotten, so the next
        step is exact. With ``overlap``, a step of more than K experts runs in waves of at most
        K // 2 and wave i+1's page-in is issued before wave i runs (``pipeline``)."""
        self.await_prefetch()
        distinct = self._read_state(ids)
        res = self.host
        admit = self.options.admit
        # Overlapped waves take half the slots they may evict into, so none reuses the previous
        # one's; a step that fits K runs as one wave (splitting it would only add a wave's cost).
        room = min(admit or self.num_slots, self.num_slots)
        split = self.options.overlap and len(distinct) > self.num_slots and room >= 2
        before = res.table()
        try:
            waves = plan_waves(res, distinct, room // 2 if split else None, admit=admit)
        except BaseException:
            res.load_table(before)  # nothing was paged: the step never happened
            raise
        self.host_stats.steps += 1
        stream = self.copy_stream() if split and self.device.type == "cuda" else None
        pipe = CopyPipeline(self.page_in, self.slot_map, self.device, stream)
        ahead = 1 if split else 0  # waves whose page-in is issued before the running one computes
        try:
            for i, wave in enumerate(waves):
                while pipe.issued <= min(i + ahead, len(waves) - 1):
                    pipe.issue(waves[pipe.issued])
                if i == 0 and after_page_in is not None:
                    after_page_in()
                to_slot = pipe.ready(i)
                self.host_stats.waves += 1
                self.host_stats.hits += wave.hits
                run_wave(wave, to_slot, len(waves))
                pipe.computed()
        except BaseException:
            # plan_waves placed every wave up front: the slots of waves not yet paged in do not
            # hold what the residency says.
            res.invalidate(s for w in waves[pipe.issued :] for _, s in w.loads)
            pipe.drain()
            raise
        finally:
            if self.device_state is not None:
                self.device_state.push(res)
        if not waves and after_page_in is not None:  # nothing routed: still once per step
            after_page_in()
        if self.options.verify:
            self.check_slots()
        self._stepped()
        return len(waves)

    def _read_state(self, ids: torch.Tensor) -> list[int]:
        """Bring ``host`` up to date and return the step's distinct valid experts (one sync)."""
        if self.device_state is not None:
            return self.device_state.pull(self.host, ids)
        valid = (ids >= 0) & (ids < self.num_experts)
        return torch.unique(ids[valid]).tolist()

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

    def page_in(self, loads: Sequence[tuple[int, int]], prefetch: bool = False) -> None:
        """Copy the host rows of ``loads`` ((expert, slot) pairs) into their slots and count them
        (as ``prefetched`` for a prefetch, else as misses). On failure the targeted slots are
        forgotten and ``PageInError`` is raised."""
        if not loads:
            return
        try:
            with self.timer.span():
                self.store.page_in(self.name, loads)
        except Exception as exc:
            # The targeted slots hold unknown contents now: forget them.
            self.host.invalidate(s for _, s in loads)
            self.mark_written()
            if isinstance(exc, PageInError):
                raise
            raise PageInError(f"layer {self.name}: page-in of {len(loads)} experts failed: {exc}") from exc
        if prefetch:
            self.host_stats.prefetched += len(loads)
        else:
            self.host_stats.misses += len(loads)
        self.host_stats.bytes_paged += len(loads) * self.row_bytes
        self.mark_written()
        if self.options.verify:
            # Against the loads, not the residency: plan_waves has already placed later waves.
            self._check_rows(loads)

    # -- edits made in place after wrap --------------------------------------------------------
    def _versions(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Version counters of the host rows and of the slots (torch bumps them on every in-place
        write made through torch; a kernel writing through raw pointers, as the gather, does not)."""
        store, name = self.store, self.name
        return (tuple(store.host_rows(name, n)._version for n in self.specs),
                tuple(store.slots(name, n)._version for n in self.specs))

    def mark_written(self) -> None:
        """Record the rows and slots as moepage itself left them (after each of its writes)."""
        self._seen = self._versions()

    def follow_edits(self) -> None:
        """Before an eager step: host rows written in place since (a ``state_dict()`` entry, which
        *is* the host rows) are copied into the slots of their resident experts; slots written in
        place (a ``parameters()`` entry: K rows of the E) are a ``ConfigError``, since such an edit
        would reach only the resident experts and be undone by the next page-in."""
        host, slots = self._versions()
        if slots != self._seen[1]:
            edited = [n for n, now, seen in zip(self.specs, slots, self._seen[1]) if now != seen]
            raise ConfigError(
                f"layer {self.name}: {', '.join(map(repr, edited))} (the slot table of the K={self.num_slots} "
                f"resident experts of {self.num_experts}, which model.parameters() shows) was written in place "
                "after wrap; the edit reaches only the resident experts and the next page-in undoes it. Edit the "
                "host rows instead (model.state_dict() entries hold every expert; in-place edits there are "
                "followed), or moepage.unwrap the model, edit it and wrap it again"
            )
        if host != self._seen[0]:
            self.refresh_slots()

    def slot_edits(self) -> list[str]:
        """The paged tensors whose slots were written in place since moepage last wrote them."""
        return [n for n, now, seen in zip(self.specs, self._versions()[1], self._seen[1]) if now != seen]

    def refresh_slots(self) -> None:
        """Copy every resident expert's host rows into its slot (after the host rows changed)."""
        slot_expert = self.residency.slot_expert  # waits for a pending prefetch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no page-in still reads what we overwrite
        with torch.no_grad():
            for name in self.specs:
                host, slots = self.store.host_rows(self.name, name), self.store.slots(self.name, name)
                for slot, expert in enumerate(slot_expert):
                    if expert >= 0:
                        slots[slot].copy_(host[expert])
        self.mark_written()

    # -- verify --------------------------------------------------------------------------------
    def check_slots(self, slots: list[int] | None = None) -> None:
        """Raise ``VerifyError`` unless every given (default: every) resident slot equals its host row."""
        slot_expert = self.residency.slot_expert  # waits for a pending prefetch
        self._check_rows([(slot_expert[s], s) for s in (range(self.num_slots) if slots is None else slots)])

    def _check_rows(self, pairs: Sequence[tuple[int, int]]) -> None:
        for e, s in pairs:
            if e < 0:
                continue
            for name in self.specs:
                host = self.store.host_rows(self.name, name)[e]
                if not torch.equal(host, self.store.slots(self.name, name)[s].to(host.device)):
                    raise VerifyError(f"layer {self.name}: slot {s} of {name!r} differs from host row of expert {e}")
