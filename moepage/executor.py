"""One paged step of one layer: plan -> page-in -> run on slots -> merge -> reduce.

``PagedLayer`` is what ``wrap`` attaches to an experts module. Its ``forward`` replaces the
module's: it splits the step's routed experts into waves (``residency.plan_waves``), pages each
wave's missing experts in through the store, runs the module's own forward over the wave's
entries with routed ids remapped to slot ids (``runners``), writes each entry into one merged
buffer, and reduces that buffer as the unpaged layer would. A single wave writes no merge buffer:
its output already is the merged buffer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
import torch

from .errors import ConfigError, PageInError, VerifyError
from .residency import Residency, plan_waves
from .runners import ExpertsForward, runner_for
from .store import PagedExpertStore, RowSpec, layer_row_bytes


@dataclass
class LayerStats:
    """Counters of one paged layer (``moepage.stats``)."""

    steps: int = 0
    waves: int = 0
    hits: int = 0  # routed experts already resident when their wave ran
    misses: int = 0  # routed experts paged in
    bytes_paged: int = 0

    @property
    def experts_paged(self) -> int:
        return self.misses

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "experts_paged": self.experts_paged, "hit_rate": self.hit_rate}


class PagedLayer:
    """Paging state and step of one experts module."""

    def __init__(
        self,
        name: str,
        module: torch.nn.Module,
        store: PagedExpertStore,
        specs: dict[str, RowSpec],
        num_experts: int,
        num_slots: int,
        top_k: int | None,
        runner: str | None,
        verify: bool,
        original_forward: ExpertsForward,
    ):
        self.name = name
        self.module_ref = module
        self.store = store
        self.specs = specs
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.top_k = top_k
        self.runner = runner
        self.verify = verify
        self.original_forward = original_forward
        self.original_device = module._parameters[next(iter(specs))].device
        self.residency = Residency(num_experts, num_slots)
        self.stats = LayerStats()
        self.row_bytes = layer_row_bytes(specs)

    # -- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        self._check_step(top_k_index)
        e = self.num_experts
        t, k = top_k_index.shape
        device = hidden.device
        runner = runner_for(self.module_ref, self.runner)
        valid = (top_k_index >= 0) & (top_k_index < e)
        distinct = torch.unique(top_k_index[valid]).tolist()  # the host plan needs them
        waves = plan_waves(self.residency, distinct)
        self.stats.steps += 1

        tokens = runner.entry_tokens(t, k, device)
        # Padding maps to index E, whose slot is -1: never computed, never paged.
        flat_ids = runner.entries(torch.where(valid, top_k_index, e))
        merged = None
        for wave in waves:
            self._page_in(wave.loads)
            self.stats.waves += 1
            self.stats.hits += wave.hits
            to_slot = torch.full((e + 1,), -1, dtype=torch.long)
            to_slot[list(wave.experts)] = torch.tensor(wave.slots, dtype=torch.long)
            slots = to_slot.to(device, non_blocking=True)[flat_ids]
            if len(waves) == 1 and len(distinct) and bool(valid.all()):
                merged = runner.run(self.original_forward, hidden, None, tokens, slots, top_k_weights.dtype)
                break
            rows = (slots >= 0).nonzero().squeeze(1)
            out = runner.run(self.original_forward, hidden, rows, tokens, slots, top_k_weights.dtype)
            if merged is None:
                merged = torch.zeros(t * k, hidden.shape[-1], dtype=out.dtype, device=device)
            merged[rows] = out
        if merged is None:  # nothing routed: every entry is padding
            merged = torch.zeros(t * k, hidden.shape[-1], dtype=hidden.dtype, device=device)
        return runner.reduce(merged, top_k_index, top_k_weights, valid, hidden.dtype)

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

    # -- paging ------------------------------------------------------------------------------
    def _page_in(self, loads: tuple[tuple[int, int], ...]) -> None:
        if not loads:
            return
        try:
            self.store.page_in(self.name, loads)
        except Exception as exc:
            # The targeted slots hold unknown contents now: forget them, so the next step
            # pages what it needs and stays exact.
            self.residency.invalidate(s for _, s in loads)
            if isinstance(exc, PageInError):
                raise
            raise PageInError(f"layer {self.name}: page-in of {len(loads)} experts failed: {exc}") from exc
        self.stats.misses += len(loads)
        self.stats.bytes_paged += len(loads) * self.row_bytes
        if self.verify:
            self.check_slots([s for _, s in loads])

    def check_slots(self, slots: list[int] | None = None) -> None:
        """Raise ``VerifyError`` unless every given (default: every) resident slot equals its host row."""
        slot_expert = self.residency.slot_expert
        for s in range(self.num_slots) if slots is None else slots:
            e = slot_expert[s]
            if e < 0:
                continue
            for name in self.specs:
                host = self.store.host_rows(self.name, name)[e]
                dev = self.store.slots(self.name, name)[s]
                if not torch.equal(host, dev.to(host.device)):
                    raise VerifyError(
                        f"layer {self.name}: slot {s} of {name!r} differs from host row of expert {e}"
                    )


def attach(module: torch.nn.Module, layer: PagedLayer) -> None:
    """Route ``module``'s forward through ``layer``."""
    module._moepage = layer  # type: ignore[attr-defined]
    module.forward = layer.forward  # type: ignore[method-assign]


def paged_layer(module: torch.nn.Module) -> PagedLayer | None:
    return getattr(module, "_moepage", None)

