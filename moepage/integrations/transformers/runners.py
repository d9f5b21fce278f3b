"""transformers' experts implementations as moepage runners (data, no code; the ``moepage.runners`` entry point, no
transformers import), followed through ``config._experts_implementation``, read at every step as transformers reads it.
- ``eager``: expert order; it synchronises (``nonzero``), so it is never captured. Some loops one-hot encode ids with
  ``num_experts`` classes (gpt-oss): per-entry waves run on their own rows. Loops accumulate in the hidden dtype,
  NemotronH's in the router weights' dtype, OpenAI privacy filter's in float32 (from float32 compute): the variants,
  chosen per module by the executor's check.
- ``grouped_mm``/``deepgemm`` (``torch.sort(expert_ids)``, a grouped GEMM) and ``batched_mm`` (a ``bmm`` per entry):
  the router weight, then ``sum(dim=1)``. Both skip ids >= ``num_experts`` safely (``skips_sentinel``; from 5.19 when
  ``_is_expert_parallel`` is set, transformers' sentinel for experts not this module's, which a wave sets for the other
  waves' entries; 5.17 clamps them always). A module no implementation names (no ``config._experts_implementation``,
  e.g. 5.17's ``Step3p7Experts``, whose loop one-hot encodes ids with ``num_experts`` classes) gets the generic runner,
  which declares no sentinel: its waves run on their own rows.
- ``sonicmoe`` is not registered: its kernel reduces over k in an order a step of several waves cannot reproduce.
- On CPU a GEMM's row may depend on its place among the rows (MKL's M-tail kernels, ~1 ulp in fp32) and ``torch.sort``
  is unstable beyond 16 entries, so grouped gets each expert's rows in the unpaged order (``sort_ties``); on CUDA a
  grouped GEMM computes each row alone (checked ``torch.equal`` on an H200), so it runs on slot ids directly."""

from __future__ import annotations

from dataclasses import replace

import torch

from ...contract import (
    ANY_DEVICE,
    ExpertOrder,
    Runner,
    TopkSum,
    accumulator_variants,
    register_cpu_expert,
    register_diagnosis,
    register_resolver,
    register_runner,
)

SENTINEL_FLAG = "_is_expert_parallel"

_EAGER = ExpertOrder("eager", syncs=True)
# grouped_mm counts rows per expert with histc(min=0, max=num_experts - 1): for one expert both are 0
# and histc takes its range from the data, so the sentinel rows join expert 0's group.
_GROUPED = TopkSum("grouped_mm", direct_on=frozenset({"cuda"}), sort_ties=True, skips_sentinel=True,
                   sentinel_flag=SENTINEL_FLAG, sentinel_from=2)
IMPLEMENTATIONS: dict[str, Runner] = {
    "eager": replace(_EAGER, variants=accumulator_variants(_EAGER)),
    "grouped_mm": _GROUPED,
    "deepgemm": _GROUPED,
    "batched_mm": TopkSum("batched_mm", direct_on=frozenset({ANY_DEVICE}), skips_sentinel=True,
                          sentinel_flag=SENTINEL_FLAG),
}


def experts_implementation(module: torch.nn.Module) -> str | None:
    """The module's HF experts implementation (``config._experts_implementation``), if any."""
    return getattr(getattr(module, "config", None), "_experts_implementation", None) or None


def register() -> None:
    """Entry point (``moepage.runners``): register HF's implementation names and the resolver."""
    for name, runner in IMPLEMENTATIONS.items():
        register_runner(name, runner)
    register_resolver(experts_implementation)
    from .check import diagnosis
    from .cpu_experts import cpu_expert

    register_cpu_expert(cpu_expert)
    register_diagnosis(diagnosis)
