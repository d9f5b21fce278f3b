"""The real routing traces in the project's shared folder (``$MOEPAGE_TRACES`` or
``../shared/data/traces``): where they are, what each is, and how to read it with moepage's
readers (``moepage.planning.traces``)."""

from __future__ import annotations

import os
from pathlib import Path

SHARED = Path(os.environ.get("MOEPAGE_TRACES") or Path(__file__).resolve().parents[3] / "shared" / "data" / "traces")

# spec (relative to SHARED) -> E where the file does not say it
REAL = {
    "granite_1b_a400m_onnxgenai/moe_expert_trace.json": None,  # IBM Granite-3.0-1B-A400M, greedy generation
    "granite_1b_a400m_onnxgenai/moe_expert_trace.json#decode": None,
    "flame_moe_290m_dynande/flame_moe_290m_routing.npz": 64,  # FLAME-MoE-290M, teacher-forced
    "qwen15moe_vllm_totaniyash/moe_routes.jsonl": 60,  # Qwen1.5-MoE-A2.7B on vLLM, layer 0
    "unknown_12L_64E_top1_exflow_format/trace.npy": 64,
}
GRANITE = "granite_1b_a400m_onnxgenai/moe_expert_trace.json"
CALIBRATION_SOURCE = "aggregates_mbolt_qwen3_30b/coactivation_qwen3-30b-a3b.json"  # Qwen3-30B-A3B's decode heat


def load(spec: str):
    """A real trace by its spec (``REAL``)."""
    from moepage.planning import traces

    return traces.load_trace(SHARED / spec, num_experts=REAL.get(spec, REAL.get(spec.split("#")[0])))
