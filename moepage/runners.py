"""The runner contract: how an experts module's own computation runs over slot ids, and how its
per-entry outputs are reduced exactly as the unpaged module reduces them; and the open registry
of runners, keyed by what they are.

An experts module computes ``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) ->
[T, H]`` = ``sum_k w * expert_k(x)``. A runner drives it two ways:

- **direct** (``Runner.direct``): the module's forward on slot ids instead of expert ids, with the
  real weights. Exact where relabelling the experts changes no entry's bits and the sum over k
  does not depend on the labels; one call, no merge, no reduction of our own.
- **per entry**: fed one entry per row (top_k = 1) with unit weights, the module returns the
  *unweighted* output of each entry with no sum (adding one term to zero is exact). Rows are laid
  out in the order the module visits tokens within an expert, so every expert's GEMM sees the same
  token set in the same order as without paging. ``reduce`` then applies the router weight and
  sums the entries as the module does. Steps of several waves merge their entries this way.

Two reductions exist in the wild, one runner each here: ``ExpertOrder`` (a loop over experts in
ascending id adding weighted entries with ``index_add_``) and ``TopkSum`` (weighted entries summed
over k with ``sum(dim=1)``). Framework integrations register their implementations' names (and
their quirks, as subclasses) with ``register_runner`` and say which name a module uses with
``register_resolver``; installed integrations are found through the ``moepage.runners`` entry
point group, so the core knows the contract and no framework.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Callable

import torch

from .errors import ConfigError

logger = logging.getLogger("moepage")

ExpertsForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Resolver = Callable[[torch.nn.Module], "str | None"]
ENTRY_POINT_GROUP = "moepage.runners"


class Runner:
    """Entry order + reduction of one kind of experts computation. Subclasses set ``k_major`` and
    ``reduce``; quirks of a particular implementation override ``direct``, ``tie_rank``,
    ``order_rows`` or ``forward_rows``."""

    name = "runner"
    k_major = False  # rows ordered (k, token) rather than (token, k)
    # The module's own forward synchronises (it cannot be captured): a per-entry wave then runs on
    # its own rows, selected on the host, and no row needs a slot id the module must skip.
    syncs = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def direct(self, device: torch.device) -> bool:
        """Whether the module's forward on slot ids (real weights) equals the unpaged output."""
        return False

    def skip_slot(self, num_slots: int) -> int:
        """The slot id of a per-entry row whose result is dropped (padding, another wave's
        entry): the sentinel K, which an HF-style implementation skips."""
        return num_slots

    def entry_tokens(self, num_tokens: int, top_k: int, device: torch.device) -> torch.Tensor:
        """Token index of every row, in this runner's entry order."""
        t = torch.arange(num_tokens, device=device)
        return t.repeat(top_k) if self.k_major else t.repeat_interleave(top_k)

    def entries(self, x: torch.Tensor) -> torch.Tensor:
        """A ``[T, k]`` routing tensor flattened into this runner's entry order."""
        return (x.t() if self.k_major else x).reshape(-1)

    def tie_rank(self, top_k_index: torch.Tensor) -> torch.Tensor | None:
        """Where each entry sits in the unpaged module's own grouping of the step (None: its
        place does not change its result)."""
        return None

    def order_rows(self, slots: torch.Tensor, rank: torch.Tensor, n: int) -> torch.Tensor:
        """An order of the rows that reproduces the unpaged grouping, given ``tie_rank``."""
        raise NotImplementedError(f"{self!r} gives a tie_rank but no order_rows")

    def forward_rows(
        self, forward: ExpertsForward, x: torch.Tensor, slots: torch.Tensor, weight_dtype: torch.dtype, total: int
    ) -> torch.Tensor:
        """The module's forward on rows ``x`` with one entry each (slot ``slots``), unit weights."""
        ones = torch.ones(slots.shape[0], 1, dtype=weight_dtype, device=x.device)
        return forward(x, slots[:, None], ones)

    def run(
        self,
        forward: ExpertsForward,
        hidden: torch.Tensor,
        rows: torch.Tensor | None,
        row_tokens: torch.Tensor,
        row_slots: torch.Tensor,
        weight_dtype: torch.dtype,
        rank: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Unweighted output of the entries ``rows`` (all when None) on their slots, in the
        order of ``rows``. ``rank``: ``tie_rank`` of the step, where the runner has one."""
        tokens = row_tokens if rows is None else row_tokens[rows]
        slots = row_slots if rows is None else row_slots[rows]
        order = None
        if rank is not None:
            order = self.order_rows(slots, rank if rows is None else rank[rows], rank.numel())
            tokens, slots = tokens[order], slots[order]
        out = self.forward_rows(forward, hidden[tokens], slots, weight_dtype, row_tokens.shape[0])
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
        raise NotImplementedError


class TopkSum(Runner):
    """Weighted entries summed over k with ``sum(dim=1)``, then cast to the hidden dtype; rows in
    (token, k) order. Direct on slot ids: a relabelling changes neither an entry nor the sum."""

    name = "topk_sum"

    def direct(self, device: torch.device) -> bool:
        return True

    def reduce(self, merged, top_k_index, top_k_weights, valid, out_dtype):
        t, k = top_k_index.shape
        weighted = merged.view(t, k, merged.shape[-1]) * top_k_weights[..., None]
        weighted = weighted.masked_fill(~valid[..., None], 0)
        return weighted.sum(dim=1).to(out_dtype)


class ExpertOrder(Runner):
    """A loop over experts in ascending id: for each token, weighted entries cast to the hidden
    dtype are added to zero in that order; rows in (k, token) order. Never direct: slot order is
    not expert order."""

    name = "expert_order"
    k_major = True

    def reduce(self, merged, top_k_index, top_k_weights, valid, out_dtype):
        t, k = top_k_index.shape
        h = merged.shape[-1]
        contrib = (merged.view(k, t, h) * top_k_weights.t()[..., None]).to(out_dtype)
        contrib = contrib.masked_fill(~valid.t()[..., None], 0)
        order = torch.argsort(top_k_index.masked_fill(~valid, torch.iinfo(top_k_index.dtype).max).t(), dim=0)
        contrib = contrib.gather(0, order[..., None].expand(k, t, h))
        out = torch.zeros(t, h, dtype=out_dtype, device=merged.device)
        for j in range(k):
            out = out + contrib[j]
        return out


def sort_rank(ids: torch.Tensor) -> torch.Tensor:
    """Where every element of ``ids`` (flattened) lands in ``torch.sort(ids)``: the order an
    implementation that groups entries by an unstable sort visits them in."""
    perm = torch.sort(ids.reshape(-1))[1]
    rank = torch.empty_like(perm)
    rank[perm] = torch.arange(perm.numel(), device=perm.device)
    return rank


def order_for_sort(slots: torch.Tensor, rank: torch.Tensor, n: int) -> torch.Tensor:
    """An order of rows such that ``torch.sort`` of their slot ids groups them by slot with each
    group in ascending ``rank`` (< ``n``): run in that order, an implementation that groups its
    rows by an unstable sort hands every expert its rows in the unpaged order. Sync-free."""
    want = torch.argsort(slots * n + rank)  # distinct keys: the target grouped order
    # Permuting rows within equal slot ids leaves the id array, hence the sort's permutation
    # ``p``, unchanged: place the rows where ``p`` will fetch them from.
    p = torch.sort(slots[want])[1]
    order = torch.empty_like(want)
    order[p] = want
    return order


EXPERT_ORDER = ExpertOrder()
TOPK_SUM = TopkSum()

_RUNNERS: dict[str, Runner] = {"expert_order": EXPERT_ORDER, "topk_sum": TOPK_SUM}
_RESOLVERS: list[Resolver] = []
_providers_loaded = False
_providers: list[str] = []  # the entry points that registered


def register_runner(name: str, runner: Runner) -> None:
    """Make ``runner`` available as ``wrap(..., implementation=name)`` and to resolvers."""
    _RUNNERS[name] = runner


def register_resolver(resolver: Resolver) -> None:
    """Add a function that names the runner of a module (None: it does not know the module)."""
    if resolver not in _RESOLVERS:
        _RESOLVERS.append(resolver)


def _load_providers() -> None:
    """Register what installed integrations provide (entry point group ``moepage.runners``)."""
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


_warned_no_providers = False


def _warn_no_providers(module: torch.nn.Module) -> None:
    # Running from a source tree without package metadata: the integrations' runners (which keep
    # their modules' summation order, hence bit-exactness on CUDA) are silently absent otherwise.
    global _warned_no_providers
    _warned_no_providers = True
    logger.warning(
        "moepage: no runner provider is installed (entry point group %r), so %s uses the generic "
        "expert_order runner; integrations' runners are not registered and paged outputs may differ "
        "from unpaged in the last bit. Install moepage (pip install -e .) to register them.",
        ENTRY_POINT_GROUP, type(module).__name__,
    )


def known_runners() -> list[str]:
    _load_providers()
    return sorted(_RUNNERS)


def runner_for(module: torch.nn.Module, declared: "str | Runner | None" = None) -> Runner:
    """The runner of ``module``: ``declared`` (a name or a ``Runner``), else the name a registered
    resolver gives, else ``expert_order``. An unknown name is a ``ConfigError``."""
    if isinstance(declared, Runner):
        return declared
    _load_providers()
    name = declared
    if name is None:
        name = next((n for n in (r(module) for r in _RESOLVERS) if n), None)
    if name is None:
        if not _providers and not _warned_no_providers:
            _warn_no_providers(module)
        return EXPERT_ORDER
    try:
        return _RUNNERS[name]
    except KeyError:
        hint = "" if _providers else (
            f" No runner provider is installed (entry point group {ENTRY_POINT_GROUP!r}): moepage runs "
            "from a source tree without its package metadata; pip install it (pip install -e .)."
        )
        raise ConfigError(
            f"no moepage runner for experts implementation {name!r}; known: {known_runners()}. "
            f"Pass implementation= one of them, or register one with moepage.register_runner.{hint}"
        ) from None
