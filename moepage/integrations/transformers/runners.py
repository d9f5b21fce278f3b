"""Hugging Face transformers' experts implementations as moepage runners (data, no code).

Registered through the ``moepage.runners`` entry point (``register``), so ``moepage.wrap`` of an HF
model follows its ``config._experts_implementation``, read at every step as transformers reads it,
without importing transformers:

- ``eager`` (each class's own loop over the experts hit, ``index_add_``): expert order. It
  synchronises (``nonzero``), so it is never captured, and some loops one-hot encode ids with
  ``num_experts`` classes (gpt-oss): per-entry waves run on their own rows. Most loops accumulate
  in the hidden dtype; NemotronH's in the router weights' dtype and OpenAI's privacy filter's in
  float32 from float32 compute: the variants, chosen per module by the executor's check.
- ``grouped_mm`` and ``deepgemm``: entries grouped with ``torch.sort(expert_ids)``, a grouped GEMM,
  the router weight, ``sum(dim=1)``.
- ``batched_mm``: one ``bmm`` per entry, the router weight, ``sum(dim=1)``.
- ``sonicmoe`` is not registered: its kernel reduces over k internally, in an order moepage
  cannot reproduce for a step of several waves.

The grouped and batched forwards skip ids >= ``num_experts`` safely (clamped bias gathers, zeroed
rows) when ``_is_expert_parallel`` is set: transformers' own sentinel for experts that are not
this module's, which a wave's call sets for the other waves' entries.

On CPU a GEMM's result for a row may depend on the row's place among the rows (MKL's M-tail
kernels, ~1 ulp in fp32), and ``torch.sort`` is not stable (``std::sort`` beyond 16 entries): the
grouped forward then gets each expert's rows in the unpaged within-expert order (``sort_ties``). On
CUDA a grouped GEMM computes each row from that row alone (checked ``torch.equal`` on an H200), so
there it runs directly on slot ids.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ...contract import ANY_DEVICE, ExpertOrder, Runner, TopkSum, accumulator_variants, register_resolver, register_runner

SENTINEL_FLAG = "_is_expert_parallel"

_EAGER = ExpertOrder("eager", syncs=True)
# grouped_mm counts rows per expert with histc(min=0, max=num_experts - 1): for one expert both are 0
# and histc takes its range from the data, so the sentinel rows join expert 0's group.
_GROUPED = TopkSum("grouped_mm", direct_on=frozenset({"cuda"}), sort_ties=True, sentinel_flag=SENTINEL_FLAG,
                   sentinel_from=2)
IMPLEMENTATIONS: dict[str, Runner] = {
    "eager": replace(_EAGER, variants=accumulator_variants(_EAGER)),
    "grouped_mm": _GROUPED,
    "deepgemm": _GROUPED,
    "batched_mm": TopkSum("batched_mm", direct_on=frozenset({ANY_DEVICE}), sentinel_flag=SENTINEL_FLAG),
}


def experts_implementation(module: torch.nn.Module) -> str | None:
    """The module's HF experts implementation (``config._experts_implementation``), if any."""
    return getattr(getattr(module, "config", None), "_experts_implementation", None) or None


def register() -> None:
    """Entry point (``moepage.runners``): register HF's implementation names and the resolver."""
    for name, runner in IMPLEMENTATIONS.items():
        register_runner(name, runner)
    register_resolver(experts_implementation)
