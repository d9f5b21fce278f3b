"""The runner contract: how an experts module's own computation runs over slot ids, how its
entries are reduced exactly as the unpaged module reduces them, and the registry of runners.

A step runs the module **direct** (its forward on slot ids with the real weights: exact where
relabelling changes no entry's bits, ``Runner.direct_on``, and always at K = E) or **per entry**
(``Runner.run``: one entry per row with unit weights, so the module returns each entry unweighted;
``reduce`` then weights and sums them as the module does). Two reductions exist in the wild:
``expert_order`` (a loop over experts in ascending id, ``index_add_`` into an accumulator of the
hidden, the weights' or float32's dtype) and ``topk_sum`` (``sum(dim=1)`` over k); the rest are
quirks, as fields. Integrations register runners by name and resolvers that name a module's
(found through the ``moepage.runners`` entry points), so the core knows no framework;
``runner_for`` is asked at every step, so a module that switches implementation is followed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from importlib.metadata import entry_points
from typing import Literal, Protocol

import torch

from .errors import ConfigError

logger = logging.getLogger("moepage")

ExpertsForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Resolver = Callable[[torch.nn.Module], "str | None"]
CpuResolver = Callable[[torch.nn.Module], "CpuExpert | str | None"]  # a str: why it cannot
Diagnosis = Callable[[torch.nn.Module], "str | None"]  # why a model holds no experts module moepage pages
ENTRY_POINT_GROUP = "moepage.runners"
ANY_DEVICE = "*"


@dataclass(frozen=True)
class Runner:
    """Entry order, quirks and reduction of one kind of experts computation.

    - ``reduction``: ``expert_order`` (entry rows ordered (k, token)) or ``topk_sum`` ((token, k)).
    - ``accumulate`` (expert order): the dtype entries are added in (``hidden``, ``weights`` or
      ``float32``), cast to the hidden dtype at the end.
    - ``upcast``: the module computes in float32: per-entry calls get float32 hidden states.
    - ``syncs``: the forward synchronises (never captured): a wave runs on its own rows only.
    - ``direct_on``: device types (``"*"``: any) where the forward on slot ids is exact.
    - ``sort_ties``: the module groups entries by an unstable ``torch.sort``, and off
      ``direct_on`` a row's result depends on its place: rows are ordered so the sort puts each
      where the unpaged call did.
    - ``skips_sentinel``: the forward skips ids >= ``num_experts`` safely (declared, never
      assumed): only then does a per-entry wave run every row, the other waves' entries on the
      sentinel slot K; otherwise it runs on its own rows (a host sync), so no module is fed an id
      it may index out of bounds (on CUDA a device-side assert, fatal to the process).
      ``sentinel_flag``: a module attribute making the forward skip them, set while such a call
      runs (where the module has it); ``sentinel_from``: the slot count from which it does.
    - ``variants``: other readings of the implementation, tried in order when the check of a
      module (``nn.layer``) finds this one inexact.
    """

    name: str
    reduction: Literal["expert_order", "topk_sum"] = "expert_order"
    accumulate: Literal["hidden", "weights", "float32"] = "hidden"
    upcast: bool = False
    syncs: bool = False
    direct_on: frozenset[str] = frozenset()
    sort_ties: bool = False
    skips_sentinel: bool = False
    sentinel_flag: str | None = None
    sentinel_from: int = 1
    variants: tuple[Runner, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        for what, value, allowed in (("reduction", self.reduction, ("expert_order", "topk_sum")),
                                     ("accumulate", self.accumulate, ("hidden", "weights", "float32"))):
            if value not in allowed:
                raise ValueError(f"runner {self.name!r}: {what} must be one of {', '.join(allowed)}, got {value!r}")
        object.__setattr__(self, "direct_on", frozenset(self.direct_on))

    def describe(self) -> str:
        acc = f", accumulating in the {self.accumulate} dtype" if self.k_major else ""
        return f"{self.name} ({self.reduction}{acc}{', float32 compute' if self.upcast else ''})"

    @property
    def k_major(self) -> bool:
        return self.reduction == "expert_order"

    def direct(self, device: torch.device) -> bool:
        return ANY_DEVICE in self.direct_on or device.type in self.direct_on

    def rows_only(self, device: torch.device, num_slots: int) -> bool:
        """A per-entry wave runs on its own rows only (selected on the host), not on every row
        with the others on the sentinel slot: where the module syncs anyway, is not declared to
        skip the sentinel, or would not skip it and a row's result depends on the rows beside it."""
        return (self.syncs or not self.skips_sentinel
                or (num_slots < self.sentinel_from and not self.direct(device)))

    def entry_tokens(self, num_tokens: int, top_k: int, device: torch.device) -> torch.Tensor:
        """Token index of every row, in this runner's entry order."""
        t = torch.arange(num_tokens, device=device)
        return t.repeat(top_k) if self.k_major else t.repeat_interleave(top_k)

    def entries(self, x: torch.Tensor) -> torch.Tensor:
        """A ``[T, k]`` routing tensor flattened into this runner's entry order."""
        return (x.t() if self.k_major else x).reshape(-1)

    def tie_rank(self, top_k_index: torch.Tensor) -> torch.Tensor | None:
        """Each entry's place in the unpaged module's grouping (None: its place changes nothing)."""
        if not self.sort_ties or self.direct(top_k_index.device):
            return None
        return self.entries(sort_rank(top_k_index).view(top_k_index.shape))

    @contextmanager
    def skipping(self, module: torch.nn.Module) -> Iterator[None]:
        """Within the block, ``module`` skips ids >= its ``num_experts`` (``sentinel_flag``)."""
        if self.sentinel_flag is None or not hasattr(module, self.sentinel_flag):
            yield
            return
        before = getattr(module, self.sentinel_flag)
        setattr(module, self.sentinel_flag, True)
        try:
            yield
        finally:
            setattr(module, self.sentinel_flag, before)

    def run(
        self,
        forward: ExpertsForward,
        module: torch.nn.Module,
        hidden: torch.Tensor,
        rows: torch.Tensor | None,
        row_tokens: torch.Tensor,
        row_slots: torch.Tensor,
        weight_dtype: torch.dtype,
        rank: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Unweighted outputs of the entries ``rows`` (None: all, the others on the sentinel slot)
        on their slots, in the order of ``rows``. ``rank``: the step's ``tie_rank``."""
        tokens = row_tokens if rows is None else row_tokens[rows]
        slots = row_slots if rows is None else row_slots[rows]
        order = None
        if rank is not None:
            order = order_for_sort(slots, rank if rows is None else rank[rows], rank.numel())
            tokens, slots = tokens[order], slots[order]
        x = hidden[tokens].float() if self.upcast else hidden[tokens]
        # Unit weights no narrower than the hidden states: an accumulator of the weights' dtype keeps every bit.
        ones = torch.ones(slots.shape[0], 1, dtype=torch.promote_types(x.dtype, weight_dtype), device=x.device)
        with self.skipping(module) if rows is None else nullcontext():
            out = forward(x, slots[:, None], ones)
        if order is None:
            return out
        back = torch.empty_like(out)
        back[order] = out
        return back

    def reduce(
        self,
        merged: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        valid: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """The unpaged module's final reduction over ``merged`` (rows in entry order)."""
        t, k = top_k_index.shape
        h = merged.shape[-1]
        if self.reduction == "topk_sum":
            weighted = merged.view(t, k, h) * top_k_weights[..., None]
            return weighted.masked_fill(~valid[..., None], 0).sum(dim=1).to(out_dtype)
        acc = {"hidden": out_dtype, "weights": top_k_weights.dtype, "float32": torch.float32}[self.accumulate]
        contrib = (merged.view(k, t, h) * top_k_weights.t()[..., None]).to(acc)
        contrib = contrib.masked_fill(~valid.t()[..., None], 0)
        order = torch.argsort(top_k_index.masked_fill(~valid, torch.iinfo(top_k_index.dtype).max).t(), dim=0)
        contrib = contrib.gather(0, order[..., None].expand(k, t, h))
        out = torch.zeros(t, h, dtype=acc, device=merged.device)
        for j in range(k):
            out = out + contrib[j]
        return out.to(out_dtype)


class CpuExpert(Protocol):
    """The optional capability a split step needs (``cpu_share``, ``moepage.split``): one expert of a layer computed
    on the CPU from its host rows, as the module computes it on its device (same layout, activation and biases; the
    CPU's own GEMM rounding)."""

    kind: str  # what it computes (class, layout, activation): with the row shapes, the key of the costs measured
    hidden_size: int
    params: tuple[str, ...]  # the per-expert tensors it reads: every paged tensor of the layer

    def __call__(self, x: torch.Tensor, rows: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The unweighted outputs ``[n, H]`` (float32) of the expert whose rows, as the slots hold them, are
        ``rows`` (``{param: row}``), on hidden states ``x`` ``[n, H]``."""
        ...


def ExpertOrder(name: str = "expert_order", **quirks) -> Runner:  # noqa: N802 - reads as the kind
    return Runner(name, "expert_order", **quirks)


def TopkSum(name: str = "topk_sum", **quirks) -> Runner:  # noqa: N802 - reads as the kind
    """Direct on any device unless told otherwise."""
    return Runner(name, "topk_sum", **{"direct_on": frozenset({ANY_DEVICE}), **quirks})


def accumulator_variants(runner: Runner) -> tuple[Runner, ...]:
    """The other accumulators an expert-order loop is written with: the weights' dtype, float32,
    and float32 from float32 compute."""
    return (replace(runner, accumulate="weights"), replace(runner, accumulate="float32"),
            replace(runner, accumulate="float32", upcast=True))


def sort_rank(ids: torch.Tensor) -> torch.Tensor:
    """Where each element of ``ids`` (flattened) lands in ``torch.sort(ids)``."""
    perm = torch.sort(ids.reshape(-1))[1]
    rank = torch.empty_like(perm)
    rank[perm] = torch.arange(perm.numel(), device=perm.device)
    return rank


def order_for_sort(slots: torch.Tensor, rank: torch.Tensor, n: int) -> torch.Tensor:
    """An order of rows such that ``torch.sort`` of their slot ids groups them by slot, each group
    in ascending ``rank`` (< ``n``): the unpaged order for a module grouping by that sort."""
    want = torch.argsort(slots * n + rank)  # distinct keys: the target grouped order
    # Permuting rows within equal slot ids leaves the id array, hence the sort's permutation
    # ``p``, unchanged: place the rows where ``p`` will fetch them from.
    p = torch.sort(slots[want])[1]
    order = torch.empty_like(want)
    order[p] = want
    return order


# No variants for modules no integration knows: the check cannot tell two float32 summation orders
# apart once the sum is rounded to bf16, so it never picks a reading the module did not declare.
EXPERT_ORDER = ExpertOrder()
TOPK_SUM = TopkSum()

_RUNNERS: dict[str, Runner] = {"expert_order": EXPERT_ORDER, "topk_sum": TOPK_SUM}
_RESOLVERS: list[Resolver] = []
_CPU_RESOLVERS: list[CpuResolver] = []
_DIAGNOSES: list[Diagnosis] = []
_providers_loaded = False
_providers: list[str] = []  # the entry points that registered


def register_runner(name: str, runner: Runner) -> None:
    """Make ``runner`` available as ``wrap(..., implementation=name)`` and to resolvers."""
    if not isinstance(runner, Runner):
        raise ConfigError(f"register_runner({name!r}, ...): a runner is a moepage.Runner, got {type(runner).__name__}")
    _RUNNERS[name] = runner


def register_resolver(resolver: Resolver) -> None:
    """Add a function that names the runner of a module (None: it does not know the module)."""
    if resolver not in _RESOLVERS:
        _RESOLVERS.append(resolver)


def register_cpu_expert(resolver: CpuResolver) -> None:
    """Add a function giving a module's ``CpuExpert`` (a str: why its experts cannot run on the CPU; None: it does not
    know the module). Asked at wrap with ``cpu_share`` on; a module none knows is refused for the split."""
    if resolver not in _CPU_RESOLVERS:
        _CPU_RESOLVERS.append(resolver)


def cpu_expert_for(module: torch.nn.Module) -> CpuExpert | str:
    """``module``'s ``CpuExpert``, or why there is none (the first registered resolver that knows the module says)."""
    _load_providers()
    for resolver in _CPU_RESOLVERS:
        found = resolver(module)
        if found is not None:
            return found
    return (f"no integration computes {type(module).__name__}'s experts on the CPU (register a moepage.CpuExpert "
            "with moepage.register_cpu_expert)")


def register_diagnosis(diagnosis: Diagnosis) -> None:
    """Add a function saying why a model holds no experts module moepage can page (None: it cannot tell), which
    ``wrap`` asks before refusing such a model: an integration knows its framework's MoE layouts."""
    if diagnosis not in _DIAGNOSES:
        _DIAGNOSES.append(diagnosis)


def diagnoses(module: torch.nn.Module) -> list[str]:
    """What the registered diagnoses say of ``module``."""
    _load_providers()
    return [said for said in (d(module) for d in _DIAGNOSES) if said]


def _load_providers() -> None:
    global _providers_loaded
    if _providers_loaded:
        return
    _providers_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()()
            _providers.append(ep.value)
        except Exception as exc:  # a broken provider must not break wrap for everyone else
            logger.warning("moepage: runner provider %s failed to load: %s", ep.value, exc)


# From a source tree without package metadata, the integrations' runners (their modules' summation
# order, hence bit-exactness on CUDA) would be silently absent.
NO_PROVIDERS = (f"no runner provider is installed (entry point group {ENTRY_POINT_GROUP!r}): moepage runs from a "
                "source tree without its package metadata; install it (pip install -e .) to register them")
_warned_no_providers = False


def known_runners() -> list[str]:
    _load_providers()
    return sorted(_RUNNERS)


def resolved_name(module: torch.nn.Module) -> str | None:
    """The implementation a registered resolver names for ``module`` now (None: none knows it)."""
    _load_providers()
    return next((n for n in (r(module) for r in _RESOLVERS) if n), None)


def _named(name: str) -> Runner:
    try:
        return _RUNNERS[name]
    except KeyError:
        raise ConfigError(
            f"no moepage runner for experts implementation {name!r}; known: {known_runners()}. Pass implementation= "
            f"one of them, or register one with moepage.register_runner.{'' if _providers else ' ' + NO_PROVIDERS}"
        ) from None


def runner_for(module: torch.nn.Module, declared: str | Runner | None = None) -> Runner:
    """The runner of ``module`` now: what a registered resolver names (the module's choice at this
    call), else ``declared`` (a name, or a ``Runner`` used as given), else ``expert_order``. A
    declared name the module does not follow, or an unknown one, is a ``ConfigError``."""
    global _warned_no_providers
    if isinstance(declared, Runner):
        return declared
    if declared is not None:
        _named(declared)  # an unknown name is said first
    name = resolved_name(module)
    if declared is not None and name is not None and declared != name:
        raise ConfigError(
            f"implementation={declared!r}, but {type(module).__name__} runs {name!r} (it reads its "
            "config's experts implementation at every call); switch the module itself "
            "and leave implementation= unset"
        )
    name = name or declared
    if name is None:
        if not _providers and not _warned_no_providers:
            _warned_no_providers = True
            logger.warning("moepage: %s uses the generic expert_order runner and may differ from unpaged in the "
                           "last bit: %s", type(module).__name__, NO_PROVIDERS)
        return EXPERT_ORDER
    return _named(name)
