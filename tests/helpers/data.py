"""The real routing traces in the project's shared folder (``$MOEPAGE_TRACES`` or
``../shared/data/traces``), what each is and how to read it. Tests that need them skip without
them; moepage's readers take any trace of these formats."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_TRACES = Path(os.environ.get("MOEPAGE_TRACES")
                     or Path(__file__).resolve().parents[3] / "shared" / "data" / "traces")
needs_traces = pytest.mark.skipif(not SHARED_TRACES.is_dir(),
                                  reason=f"shared traces not found at {SHARED_TRACES} (set MOEPAGE_TRACES)")

# spec (relative to SHARED_TRACES) -> E where the file does not say it
REAL_TRACES = {
    "granite_1b_a400m_onnxgenai/moe_expert_trace.json": None,
    "granite_1b_a400m_onnxgenai/moe_expert_trace.json#decode": None,
    "flame_moe_290m_dynande/flame_moe_290m_routing.npz": 64,  # FLAME-MoE-290M (its README says)
    "qwen15moe_vllm_totaniyash/moe_routes.jsonl": 60,  # Qwen1.5-MoE-A2.7B
    "unknown_12L_64E_top1_exflow_format/trace.npy": 64,
}
CALIBRATION_SOURCE = "aggregates_mbolt_qwen3_30b/coactivation_qwen3-30b-a3b.json"  # what the shipped heat comes from


def load_real(spec: str, steps: int | None = None):
    from moepage.planning import traces

    trace = traces.load_trace(SHARED_TRACES / spec, num_experts=REAL_TRACES.get(spec))
    return trace if steps is None else trace.window(0, steps)
