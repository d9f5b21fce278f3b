"""A paged experts module: ``PagedLayer`` (``wrap`` attaches it; its ``forward`` replaces the
module's) and ``ModuleWaves``, the ``step.StepComputation`` of a stacked-experts module.

Each step asks the module's implementation at this call (``contract.runner_for``). A direct
single wave, or any step at K = E, is the module's own forward on slot ids; otherwise each entry
is computed by the wave holding its expert and reduced as the unpaged module would. **The
check**: the first step of each implementation and dtypes (K < E) runs a small random two-wave
step both ways and compares them bit for bit, trying the runner's ``variants`` in order; none
matching is a ``ConfigError``: moepage never runs a reduction it has not seen reproduce the module.
"""

from __future__ import annotations

from functools import cached_property

import torch

from .. import capture
from ..bits import same_bits
from ..contract import ExpertsForward, Runner, runner_for
from ..errors import ConfigError
from ..lifetime import Lifetime
from ..pager import LayerPager
from ..prefetch import PrefetchLink
from ..step import AfterPageIn, StepWave, paged_step

_CHECK_TOKENS = 15  # tokens of the check step: odd, a few rows per slot


class ModuleWaves:
    """One step of an experts module over its slot table (a ``step.StepComputation``): the waves' per-entry outputs,
    merged (or the module's own output of a direct wave), and their reduction."""

    def __init__(self, runner: Runner, forward: ExpertsForward, module: torch.nn.Module, num_slots: int,
                 hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int):
        self.runner, self.forward, self.module, self.num_slots = runner, forward, module, num_slots
        self.hidden, self.top_k_index, self.top_k_weights = hidden, top_k_index, top_k_weights
        self.num_experts = num_experts
        self.direct = num_slots == num_experts or runner.direct(hidden.device)
        self.merged: torch.Tensor | None = None
        self.output: torch.Tensor | None = None  # of a direct wave

    # What per-entry waves and their reduction need, made on first use: a direct wave (the hit step of a captured
    # decode) launches none of these kernels.
    @cached_property
    def valid(self) -> torch.Tensor:
        return (self.top_k_index >= 0) & (self.top_k_index < self.num_experts)

    @cached_property
    def rank(self) -> torch.Tensor | None:
        """The unpaged tie order, for runners that need it."""
        return self.runner.tie_rank(self.top_k_index)

    @cached_property
    def tokens(self) -> torch.Tensor:
        t, k = self.top_k_index.shape
        return self.runner.entry_tokens(t, k, self.hidden.device)

    def run(self, wave: StepWave) -> None:
        if wave.direct:  # every routed entry is here; padding on slot K
            self.output = self.forward(self.hidden, wave.slots, self.top_k_weights)
            return
        runner = self.runner
        flat = runner.entries(wave.slots)
        mine = flat >= 0
        weight_dtype = self.top_k_weights.dtype
        if runner.rows_only(self.hidden.device, self.num_slots):  # this wave's rows alone
            rows = mine.nonzero().squeeze(1)
            out = runner.run(self.forward, self.module, self.hidden, rows, self.tokens, flat, weight_dtype, self.rank)
            if self.merged is None:
                self.merged = out.new_zeros(flat.numel(), out.shape[-1])
            self.merged[rows] = out
            return
        # Every row, in the unpaged shape (row-position-dependent kernels see the unpaged layout).
        out = runner.run(self.forward, self.module, self.hidden, None, self.tokens,
                         torch.where(mine, flat, self.num_slots), weight_dtype, self.rank)
        if self.merged is None:
            self.merged = out
        else:  # in place: a later wave may be a graph if-node's body (``capture.only_if``)
            torch.where(mine[:, None], out, self.merged, out=self.merged)

    def join(self, entries: torch.Tensor, out: torch.Tensor) -> None:
        """The CPU's entries (``split.SplitComputation``) into their rows of the merged entries, in its dtype."""
        t, k = self.top_k_index.shape
        rows = (entries % k) * t + entries // k if self.runner.k_major else entries
        device = self.hidden.device
        if self.merged is None:  # no wave ran: every routed entry is the CPU's
            dtype = torch.float32 if self.runner.upcast else self.hidden.dtype
            self.merged = torch.zeros(t * k, self.hidden.shape[-1], dtype=dtype, device=device)
        self.merged[rows.to(device)] = out.to(device=device, dtype=self.merged.dtype)

    def finish(self) -> torch.Tensor:
        if self.output is not None:
            return self.output
        merged = self.merged
        if merged is None:  # nothing routed: every entry is padding
            merged = self.hidden.new_zeros(self.top_k_index.numel(), self.hidden.shape[-1])
        return self.runner.reduce(merged, self.top_k_index, self.top_k_weights, self.valid, self.hidden.dtype)


class PagedLayer:
    """Paging state and step of one experts module."""

    def __init__(self, pager: LayerPager, lifetime: Lifetime, module: torch.nn.Module,
                 declared: str | Runner | None, original_forward: ExpertsForward):
        self.pager = pager
        self.lifetime = lifetime  # releases the layer's rows and slots (unwrap)
        self.module_ref = module
        self.declared = declared  # wrap's implementation=: used where no resolver knows the module
        self.original_forward = original_forward
        self.original_device = module._parameters[next(iter(pager.specs))].device
        self.prefetch: PrefetchLink | None = None  # the next paged layer's prefetch, issued by each step
        self.module_hooks: list = []
        self._checked: dict[tuple, Runner] = {}  # (runner, dtypes, top_k) -> the runner that matched
        self.copied: frozenset[str] = frozenset()  # tensors whose host rows state_dict() gives as copies (hooks)

    # What wrap, unwrap and stats read, from the pager.
    name = property(lambda self: self.pager.name)
    store = property(lambda self: self.pager.store)
    specs = property(lambda self: self.pager.specs)
    num_experts = property(lambda self: self.pager.num_experts)
    num_slots = property(lambda self: self.pager.num_slots)
    device = property(lambda self: self.pager.device)

    def read_stats(self):
        return self.pager.read_stats()

    def read_residency(self):
        return self.pager.read_residency()

    def check_slots(self) -> None:
        self.pager.check_slots()

    @property
    def runner(self) -> Runner:
        """The runner of the module's implementation now (not yet checked against a step)."""
        return runner_for(self.module_ref, self.declared)

    def __repr__(self) -> str:  # no device read: counters come from read_stats()
        return (f"PagedLayer({self.name}: K={self.num_slots} of E={self.num_experts} experts resident, "
                f"{self.store.name} store)")

    def __reduce_ex__(self, protocol):
        raise ConfigError(
            f"layer {self.name}: a model paged by moepage cannot be pickled or copied (torch.save(model), "
            "copy.deepcopy): its experts live in a host store. Save model.state_dict() or use save_pretrained "
            "(both hold every expert), or moepage.unwrap the model, copy it, and wrap each copy"
        )

    def __deepcopy__(self, memo):
        self.__reduce_ex__(2)

    # -- steps -------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        self._check_step(top_k_index)
        runner = self.checked_runner(hidden, top_k_weights, top_k_index.shape[1])
        if not capture.capturing():
            self.pager.follow_edits()
        return paged_step(self.pager, top_k_index, self.waves(runner, hidden, top_k_index, top_k_weights),
                          self.after_page_in(hidden))

    def waves(self, runner: Runner, hidden, top_k_index, top_k_weights) -> ModuleWaves:
        return ModuleWaves(runner, self.original_forward, self.module_ref, self.num_slots, hidden, top_k_index,
                           top_k_weights, self.num_experts)

    # -- the runner of this call ---------------------------------------------------------------------
    def checked_runner(self, hidden: torch.Tensor, top_k_weights: torch.Tensor, top_k: int) -> Runner:
        """The runner of the module's implementation now, checked once per implementation, dtypes
        and top_k against the module's own forward (see the module doc)."""
        runner = self.runner
        if self.num_slots == self.num_experts:
            return runner  # every step is the module's own forward on its own ids
        key = (runner, hidden.dtype, top_k_weights.dtype, top_k)
        if key in self._checked:
            return self._checked[key]
        if capture.capturing():
            raise ConfigError(
                f"layer {self.name}: the first step under experts implementation {runner.name!r} is being "
                "captured in a CUDA graph; run one eager step first (moepage checks the implementation there)"
            )
        self.pager.await_prefetch()  # the check reads the slots
        tried = []
        for candidate in (runner, *runner.variants):
            diff = self._mismatch(candidate, hidden, top_k_weights, top_k)
            if diff is None:
                self._checked[key] = candidate
                return candidate
            tried.append(f"{candidate.describe()}: {diff}")
        raise ConfigError(
            f"layer {self.name} ({type(self.module_ref).__name__}): moepage cannot reproduce its forward bit for "
            f"bit under experts implementation {runner.name!r} with {hidden.dtype} hidden states and "
            f"{top_k_weights.dtype} router weights, checked on a random step of two waves:\n  - "
            + "\n  - ".join(tried)
            + "\nSwitch the model to another experts implementation, or register a moepage.Runner "
            "that reduces as this module does"
        )

    def _mismatch(self, runner: Runner, hidden: torch.Tensor, top_k_weights: torch.Tensor, top_k: int) -> str | None:
        """None if the runner's merge of two waves equals the module's own forward on a random
        step over the slot table, else what differed."""
        k_slots, device = self.num_slots, hidden.device
        gen = torch.Generator().manual_seed(0)
        ids = torch.stack([torch.randperm(k_slots, generator=gen)[:top_k] for _ in range(_CHECK_TOKENS)]).to(device)
        x = torch.randn(_CHECK_TOKENS, hidden.shape[-1], generator=gen).to(device=device, dtype=hidden.dtype)
        w = (torch.rand(_CHECK_TOKENS, top_k, generator=gen) + 0.05).to(device=device, dtype=top_k_weights.dtype)
        try:
            want = self.original_forward(x, ids, w)
            # The step's merge over these slots as if each slot were an expert (waves of two: never direct).
            merge = ModuleWaves(runner, self.original_forward, self.module_ref, k_slots, x, ids, w, k_slots)
            for parity in (0, 1):  # two waves: the even and the odd slots
                if bool((ids % 2 == parity).any()):
                    merge.run(StepWave(torch.where(ids % 2 == parity, ids, -1), parity, 2))
            got = merge.finish()
        except Exception as exc:  # a reading the module cannot run (e.g. float32 inputs to bf16 weights)
            return f"raised {type(exc).__name__}: {exc}"
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"gave {got.dtype} {tuple(got.shape)}, the module {want.dtype} {tuple(want.shape)}"
        if same_bits(got, want):  # NaN payloads included: a NaN weight must not refuse every step
            return None
        return f"max |diff| {(got.double() - want.double()).abs().max().item():.3g}"

    @torch.no_grad()
    def on_device(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        """The unweighted outputs of the expert in ``slot`` on ``x``: the module's own forward (the CPU split's
        check)."""
        ids = torch.full((x.shape[0], 1), slot, dtype=torch.long, device=x.device)
        return self.original_forward(x, ids, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device))

    def after_page_in(self, hidden: torch.Tensor) -> AfterPageIn | None:
        return None if self.prefetch is None else self.prefetch.after_page_in(hidden)

    def _check_step(self, top_k_index: torch.Tensor) -> None:
        if top_k_index.dim() != 2:
            raise ConfigError(
                f"layer {self.name}: top_k_index must be [tokens, top_k], got shape {tuple(top_k_index.shape)}"
            )
        k = top_k_index.shape[1]
        if k > self.num_slots:
            raise ConfigError(
                f"layer {self.name}: routing selects top_k={k} experts per token but only "
                f"resident={self.num_slots} slots exist; need resident >= top_k"
            )
        for name in self.specs:
            param = self.module_ref._parameters.get(name)
            if param is None or param.data_ptr() != self.store.slots(self.name, name).data_ptr():
                raise ConfigError(
                    f"layer {self.name}: parameter {name!r} no longer is moepage's slot table "
                    "(was the model moved with .to() / .half() after wrap?). Pass device= to "
                    "moepage.wrap instead, or unwrap first."
                )


def attach(module: torch.nn.Module, layer: PagedLayer) -> None:
    """Route ``module``'s forward through ``layer``."""
    module._moepage = layer  # type: ignore[attr-defined]
    module.forward = layer.forward  # type: ignore[method-assign]


def paged_layer(module: torch.nn.Module) -> PagedLayer | None:
    return getattr(module, "_moepage", None)
