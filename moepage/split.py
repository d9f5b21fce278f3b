"""Split steps (``cpu_share``, off by default): an eager step pages some of its missed experts into the slots over the
link, as without it, and computes the others on the CPU from their host rows (``moepage.cpu``) while the device runs
the queued page-ins and waves; the CPU's per-entry outputs join the device's before the layer's own reduction. Not
bit-exact: the CPU's GEMMs round differently from the device's (docs/cpu-split.md says by how much).

Which misses go where is decided per step (``choose``) from ``Costs`` measured once per device, expert kind and row
shapes at start-up (``measure``): the seconds to page one expert's rows in, and the CPU's seconds for one expert as a
function of its token count (plus reading its rows: decoding coded ones, a disk tier's copy). The CPU takes the misses
with the fewest tokens first, as many as make both paths finish soonest; none where that saves less than
``1 - GAIN`` of paging them all (a large batch, a slow CPU). Each share's own time corrects the CPU's costs for its
layer (``Split.slowdown``): inside steps the CPU can be slower than alone. A fixed share (``cpu_share=0.5``) skips the
costs.

A CPU expert is not made resident and changes no residency state: it is neither a hit nor a miss but counted in
``LayerStats.cpu``. A split is planned on the host at every step; a captured step (CUDA graphs, ``capture_mode``)
is refused."""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from . import cpu
from .backends import cpu_rows
from .contract import CpuExpert
from .errors import ConfigError, PageInError

if TYPE_CHECKING:
    from .backends.protocol import PagedExpertStore, RowSpec
    from .residency import Residency
    from .telemetry import LayerStats

GAIN = 0.9  # a split must beat paging every miss by 10 %: what the costs leave out (the join, the device's compute)
LEARN = 0.25  # weight of each share's own time in a layer's ``Split.slowdown``
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)  # token counts the CPU's time is measured at (linear beyond the last)
_REPS = 3
ROWS_BUDGET = 256 * 2**20  # the measurement rotates over this many bytes of real rows (not a cache's worth)


@dataclass(frozen=True)
class Costs:
    """What a split weighs (seconds): paging one expert in, the CPU's time for one expert at ``tokens`` (ascending)
    routed tokens (``cpu_seconds``, reading its rows included), and the CPU path's fixed cost per step."""

    page_seconds: float
    tokens: tuple[int, ...]
    cpu_seconds: tuple[float, ...]
    fixed_seconds: float = 0.0

    def expert_seconds(self, n: int) -> float:
        """The CPU's time for one expert of ``n`` tokens: interpolated, extrapolated linearly past the ends."""
        ts, ss = self.tokens, self.cpu_seconds
        if len(ts) == 1:
            return ss[0]
        i = min(max(1, next((j for j, t in enumerate(ts) if t >= n), len(ts) - 1)), len(ts) - 1)
        t0, t1, s0, s1 = ts[i - 1], ts[i], ss[i - 1], ss[i]
        return max(0.0, s0 + (s1 - s0) * (n - t0) / (t1 - t0))

    def share_seconds(self, counts: Sequence[int]) -> float:
        """The CPU path's time for a share of experts with ``counts`` tokens each, the fixed cost included."""
        return self.fixed_seconds + sum(self.expert_seconds(n) for n in counts)


def choose(costs: Costs | None, misses: Sequence[int], tokens: Sequence[int], share: float | str,
           slowdown: float = 1.0) -> list[int]:
    """The misses the CPU computes this step (``tokens[e]``: entries routed to expert e), fewest tokens first:
    ``share`` of them where it is a number, else (``"auto"``) as many as make the two paths finish soonest by
    ``costs`` (the CPU's times ``slowdown`` times as long, as steps found them), none where that saves less than
    ``1 - GAIN`` of paging them all."""
    order = sorted(misses, key=lambda e: (tokens[e], e))
    if not isinstance(share, str):
        return order[: math.floor(share * len(order) + 0.5)]
    if costs is None:
        return []
    best_n, best = 0, GAIN * len(order) * costs.page_seconds
    busy = costs.fixed_seconds * slowdown
    for n, e in enumerate(order, 1):
        busy += costs.expert_seconds(tokens[e]) * slowdown
        took = max((len(order) - n) * costs.page_seconds, busy)
        if took < best:
            best_n, best = n, took
    return order[:best_n]


class SplitLayer(Protocol):
    """What a split reads of its layer (a ``pager.LayerPager``; a protocol, so this module builds on the pager and the
    step without importing them): its name, store, row specs and slots' device, its residency and its counters."""

    name: str
    store: PagedExpertStore
    specs: dict[str, RowSpec]
    num_experts: int
    row_bytes: int
    device: torch.device
    residency: Residency  # which expert each slot holds
    counts: LayerStats


# -- measured at start-up -----------------------------------------------------------------------------------------
_measured: dict[tuple, Costs] = {}
_measuring = threading.Lock()


def _timed(fn: Callable[[], object], reps: int = _REPS) -> float:
    """Median seconds of ``fn`` after one warm-up run."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _page_seconds(pager: SplitLayer) -> float:
    """One expert's rows (as the host keeps them) from (pinned) host memory into scratch on the slots' device."""
    device = pager.device
    pinned = device.type == "cuda"
    pairs = [(torch.empty(s.host_nbytes, dtype=torch.uint8, pin_memory=pinned),
              torch.empty(s.host_nbytes, dtype=torch.uint8, device=device)) for s in pager.specs.values()]

    def page() -> None:
        for host, dev in pairs:
            dev.copy_(host, non_blocking=True)
        if pinned:
            torch.cuda.synchronize(device)

    return _timed(page)


def _cpu_seconds(pager: SplitLayer, expert: CpuExpert) -> tuple[float, ...]:
    """The CPU's time for one expert at each of ``TOKENS`` (on the worker, with its threads), its rows read from the
    layer's own store (rotating over real experts, so they come from memory as a step's would), reading included."""
    names = list(pager.specs)
    count = max(1, min(pager.num_experts, ROWS_BUDGET // max(1, pager.row_bytes)))
    chosen = list(range(count))
    dtype = next(iter(pager.specs.values())).dtype

    def run() -> list[float]:
        read = _timed(lambda: cpu_rows(pager.store, pager.name, names, chosen[:1])(), reps=1)
        rows = cpu_rows(pager.store, pager.name, names, chosen)()
        x = torch.randn(TOKENS[-1], expert.hidden_size).to(dtype)
        turn = iter(range(1 << 30))
        return [read + _timed(lambda n=n: expert(x[:n], rows[next(turn) % count])) for n in TOKENS]

    return tuple(cpu.worker(pager.device).submit(run).result())


def _fixed_seconds(pager: SplitLayer, hidden: int) -> float:
    """A step's CPU path beside its shares: a round trip to the worker, the hidden states to the host and the outputs
    back to the device."""
    device = pager.device
    x = torch.zeros(8, hidden, device=device)

    def trip() -> None:
        host = x.to("cpu")
        back = cpu.worker(device).submit(lambda: host.float()).result()
        back.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return _timed(trip)


def measure(pager: SplitLayer, expert: CpuExpert) -> Costs:
    """``Costs`` of ``pager``'s layer with ``expert``: measured once per device, store, expert kind and row specs (the
    layers of a model share one measurement)."""
    key = (str(pager.device), pager.store.name, expert.kind,
           tuple((n, s.shape, s.dtype, s.code is not None) for n, s in pager.specs.items()))
    with _measuring:
        if key not in _measured:
            _measured[key] = Costs(_page_seconds(pager), TOKENS, _cpu_seconds(pager, expert),
                                   _fixed_seconds(pager, expert.hidden_size))
        return _measured[key]


# -- a layer's split, and one step's share -------------------------------------------------------------------------
class SplitComputation(Protocol):
    """A ``StepComputation`` that can take a CPU share: its hidden states and where the CPU's entries join."""

    hidden: torch.Tensor  # [T, H], the step's input

    def join(self, entries: torch.Tensor, out: torch.Tensor) -> None:
        """After its waves: the entries ``entries`` (flat ``(token, k)`` indices into the routing, on the host)
        computed on the CPU, unweighted, ``out`` ``[n, H]`` float32 on the host, into the step's entries before the
        reduction."""


def agreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative difference ``|got - want| / |want|`` (Frobenius norms, in float64)."""
    want64 = want.double()
    return ((got.double() - want64).norm() / want64.norm().clamp_min(1e-30)).item()


def tolerance(dtype: torch.dtype) -> float:
    """The relative difference the start-up check allows between an expert on the CPU and on the device: the rounding
    of two implementations of the same arithmetic, far below what a wrong layout gives (order 1)."""
    return 5e-2 if dtype.itemsize <= 2 else 1e-3


class Split:
    """One layer's split: its ``share`` (a number or "auto"), its ``CpuExpert`` and costs (``prepare``), and each
    step's share (``begin``)."""

    def __init__(self, share: float | str):
        self.share = share
        self.expert: CpuExpert | None = None
        self.costs: Costs | None = None  # "auto": measured at ``prepare``; tests may set their own
        # The CPU's time inside steps over the costs' (measured alone), learned from each share: "auto" weighs the
        # costs slowed by it, so a CPU slower in steps than alone (contention the start-up cannot see) gets less.
        self.slowdown = 1.0

    def prepare(self, pager: SplitLayer, expert: CpuExpert,
                on_device: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> None:
        """Take ``expert`` for this layer: checked against the device's computation of a resident expert where
        ``on_device(x, slot)`` gives it (unweighted outputs of the expert in ``slot``), then the costs measured."""
        if on_device is not None:
            self._check(pager, expert, on_device)
        self.expert = expert
        if self.share == "auto" and self.costs is None:
            self.costs = measure(pager, expert)

    def _check(self, pager: SplitLayer, expert: CpuExpert, on_device: Callable[[torch.Tensor, int], torch.Tensor]
               ) -> None:
        slot = next((s for s, e in enumerate(pager.residency.slot_expert) if e >= 0), None)
        if slot is None:
            return
        e = pager.residency.slot_expert[slot]
        dtype = next(iter(pager.specs.values())).dtype
        x = torch.randn(5, expert.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
        want = on_device(x.to(pager.device), slot).float().cpu()
        got = expert(x, cpu_rows(pager.store, pager.name, list(pager.specs), [e])()[0]).float()
        diff = agreement(got, want)
        if not diff <= tolerance(dtype):
            raise ConfigError(f"layer {pager.name}: cpu_share: its experts computed on the CPU ({expert.kind}) differ "
                              f"from the device's by {diff:.3g} (relative; at most {tolerance(dtype):g} is rounding), "
                              "so its layout is not the one the CPU computes; run without cpu_share")

    def begin(self, pager: SplitLayer, ids: torch.Tensor, distinct: list[int], computation: object
              ) -> StepShare | None:
        """Choose this step's CPU experts among its misses and start computing them (None: no share); reads the
        routing on the host (a sync) and what the page-ins may overwrite. ``computation``: the step's
        (``step.StepComputation``), which must be a ``SplitComputation``."""
        if self.expert is None or not hasattr(computation, "join"):
            raise ConfigError(f"layer {pager.name}: cpu_share is on but the layer's adapter gave no CPU expert (or its "
                              "step cannot join CPU outputs); run without cpu_share")
        misses = [e for e in distinct if not pager.residency.is_resident(e)]
        if not misses:
            return None
        routed = ids.to("cpu")
        valid = routed[(routed >= 0) & (routed < pager.num_experts)]
        tokens = torch.bincount(valid.long(), minlength=pager.num_experts).tolist()
        chosen = choose(self.costs, misses, tokens, self.share, self.slowdown)
        if not chosen:
            return None
        try:
            rows = cpu_rows(pager.store, pager.name, list(pager.specs), chosen)
        except Exception as exc:
            raise PageInError(f"layer {pager.name}: reading the rows of {len(chosen)} experts for the CPU failed: "
                              f"{exc}") from exc
        # Only the hidden states of the tokens routed to the CPU's experts come to the host (a prefill has many).
        needed = torch.isin(routed, torch.tensor(chosen, dtype=routed.dtype)).any(dim=1)
        hidden = computation.hidden.detach()
        x = hidden[needed.to(hidden.device)].to("cpu")
        at = torch.cumsum(needed, 0) - 1  # token -> its row of ``x``
        expected = None if self.costs is None else self.costs.share_seconds([tokens[e] for e in chosen])
        return StepShare(tuple(chosen), lambda: cpu.submit(pager.device, self.expert, rows, x, routed, chosen, at),
                         expected, self)

    def observe(self, took: float, expected: float) -> None:
        """A share took ``took`` seconds where the costs measured alone expected ``expected``: learn ``slowdown``."""
        if expected > 0:
            self.slowdown += LEARN * (took / expected - self.slowdown)


@dataclass
class StepShare:
    """The CPU's share of one step: its experts and how to start their computation. It starts at ``join``, once the
    step's waves are queued on the device: each of the worker's torch ops takes Python's lock back as it returns, and
    a driving thread still queueing waves in Python holds that lock, so every op would wait (docs/cpu-split.md)."""

    experts: tuple[int, ...]
    start: Callable[[], Future]  # submits ``cpu.compute`` to the worker
    expected: float | None = None  # its seconds by the costs measured alone ("auto"), told to ``split`` at the join
    split: Split | None = None

    def join(self, pager: SplitLayer, computation: SplitComputation) -> None:
        """Compute the CPU's share while the device runs the queued waves, then hand its outputs to ``computation``;
        count the experts (a failure: a ``PageInError``, nothing counted)."""
        try:
            began = time.perf_counter()
            entries, out = self.start().result()
            if self.split is not None and self.expected is not None:
                self.split.observe(time.perf_counter() - began, self.expected)
        except Exception as exc:
            raise PageInError(f"layer {pager.name}: computing {len(self.experts)} experts on the CPU failed: "
                              f"{exc}") from exc
        computation.join(entries, out)
        pager.counts.cpu += len(self.experts)
