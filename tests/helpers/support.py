"""The cases of the architecture matrix (``tests/integrations/transformers/test_hf_matrix.py``) and the support
table of ``docs/architectures.md`` generated from them.

    python tests/helpers/support.py            # print the table
    python tests/helpers/support.py --write docs/architectures.md   # replace the table between its markers
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers.hf_registry import MoeArch, moe_archs
else:
    from .hf_registry import MoeArch, moe_archs

IMPLS = ("eager", "grouped_mm", "batched_mm")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
TABLE_DTYPES = ("fp32", "bf16", "fp16")  # what the matrix cycles through (fp64 only in PINNED)
FLOWS = ("generate", "padded", "device_planner", "capture_mode", "switch", "state_dict", "inference_mode",
         "from_pretrained")
RESIDENT = ("top_k", "mid", "E")
START = "<!-- support-table:start (generated: python tests/helpers/support.py --write docs/architectures.md) -->"
END = "<!-- support-table:end -->"


@dataclass(frozen=True)
class Case:
    model_type: str
    impl: str
    dtype_name: str
    k: str  # one of RESIDENT
    flow: str

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    def resident(self, arch: MoeArch) -> int:
        return {"top_k": arch.top_k, "mid": (arch.top_k + arch.num_experts) // 2, "E": arch.num_experts}[self.k]

    def __str__(self) -> str:
        return f"{self.model_type}-{self.impl}-{self.dtype_name}-K{self.k}-{self.flow}"


def impls_of(arch: MoeArch) -> tuple[str, ...]:
    """The implementations an architecture runs: all, unless its experts do not dispatch."""
    return IMPLS if arch.dispatches else ("eager",)


def matrix_cases(archs: list[MoeArch]) -> list[Case]:
    """Per architecture: every implementation x {fp32, bf16}, cycled until every flow has a case,
    then every implementation in fp16; K cycles over ``RESIDENT``. Offsets by the architecture's
    index vary which combination meets which flow. Then the ``PINNED`` cases. Deterministic."""
    cases = []
    for i, arch in enumerate(archs):
        main = [(impl, d) for impl in impls_of(arch) for d in ("fp32", "bf16")]
        combos = [main[j % len(main)] for j in range(max(len(main), len(FLOWS)))]
        combos += [(impl, "fp16") for impl in impls_of(arch)]
        for j, (impl, dtype) in enumerate(combos):
            cases.append(Case(arch.model_type, impl, dtype, RESIDENT[(i + j) % 3], FLOWS[(i + j) % len(FLOWS)]))
    known = {a.model_type for a in archs}
    return cases + [c for c in PINNED if c.model_type in known and c not in cases]


# Cases found wrong once (moepage's issue on exactness wherever users go), kept whatever the cycle
# gives: NemotronH's eager loop accumulates in the router weights' dtype; OpenAI's privacy filter
# computes in float32; gpt-oss's biases were gathered with the sentinel slot in multi-wave device
# steps; with K = 1, grouped_mm's histc puts the sentinel rows into expert 0's group.
PINNED = (
    *(Case("nemotron_h", "eager", d, "top_k", "generate") for d in ("bf16", "fp16", "fp64")),
    Case("nemotron_h", "eager", "bf16", "E", "generate"),
    Case("openai_privacy_filter", "eager", "bf16", "top_k", "padded"),
    *(Case("gpt_oss", impl, d, "top_k", "capture_mode")
      for impl in ("grouped_mm", "batched_mm") for d in ("fp32", "bf16")),
    *(Case("zaya", "grouped_mm", "fp32", "top_k", flow) for flow in ("capture_mode", "generate")),
)


def switch_target(impl: str) -> str:
    """The implementation a ``switch`` case changes to after wrap."""
    return IMPLS[(IMPLS.index(impl) + 1) % len(IMPLS)]


@functools.cache
def _refusal(model_type: str, impl: str, dtype_name: str) -> str | None:
    arch = next(a for a in moe_archs() if a.model_type == model_type)
    model = arch.build().to(DTYPES[dtype_name])
    ids = torch.randint(1, arch.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    try:
        if arch.dispatches:
            model.set_experts_implementation(impl)
        with torch.no_grad():
            out = model(input_ids=ids)
    except Exception as exc:  # noqa: BLE001 - the reason is reported
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    first = out.logits if arch.causal_lm else out.last_hidden_state
    return None if torch.isfinite(first).all() else "non-finite outputs"


def unpaged_refusal(arch: MoeArch, impl: str, dtype: torch.dtype) -> str | None:
    """Why the unpaged model cannot run ``impl`` in ``dtype`` on this machine, or None."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _refusal(arch.model_type, impl, next(n for n, d in DTYPES.items() if d == dtype))
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _moepage_refusal(model_type: str) -> str | None:
    from moepage import ConfigError
    from moepage.integrations.transformers import check_supported

    arch = next(a for a in moe_archs() if a.model_type == model_type)
    try:
        check_supported(arch.build())
    except ConfigError as exc:
        line = str(exc).splitlines()[1]  # the first layer's: "  - <name>: <experts class>: <reason>"
        return line[line.index(arch.experts_class) + len(arch.experts_class):].lstrip(": ")
    return None


def moepage_refusal(arch: MoeArch) -> str | None:
    """Why moepage refuses to page ``arch`` (``check_supported``), or None."""
    return _moepage_refusal(arch.model_type)


def table(archs: list[MoeArch]) -> str:
    """The support table: per model type, the dtypes the matrix runs (and checks exact) under each
    implementation; or why moepage refuses it."""
    lines = [START, "", "| model type | experts class | " + " | ".join(IMPLS) + " |", "|---|---|" + "---|" * len(IMPLS)]
    for arch in archs:
        if why := moepage_refusal(arch):
            lines.append(f"| {arch.model_type} | {arch.experts_class} | refused: {why} |" + " |" * (len(IMPLS) - 1))
            continue
        cells = []
        for impl in IMPLS:
            runs = [n for n in TABLE_DTYPES
                    if impl in impls_of(arch) and unpaged_refusal(arch, impl, DTYPES[n]) is None]
            cells.append(" ".join(runs) if runs else "—")
        lines.append(f"| {arch.model_type} | {arch.experts_class} | " + " | ".join(cells) + " |")
    lines += ["", END]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    text = table(moe_archs())
    if argv[:1] == ["--write"]:
        path = Path(argv[1])
        readme = path.read_text()
        if START in readme and END in readme:
            readme = readme[: readme.index(START)] + text + readme[readme.index(END) + len(END):]
        else:
            readme += "\n" + text + "\n"
        path.write_text(readme)
    else:
        print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
