"""moepage's vLLM plugin: pages every routed-experts layer of a vLLM engine through moepage's store, residency and
step, with vLLM's own loaders and kernels. Importing this package does not import vLLM.

    pip install "moepage[vllm]"
    vllm serve MODEL --paged-experts-num-resident K
    LLM(MODEL, additional_config={"moepage": {"num_resident": K}})
"""

from __future__ import annotations

from .plugin import ENTRY_POINT_GROUP, ENTRY_POINT_NAME, register

__all__ = ["register", "stats", "ENTRY_POINT_GROUP", "ENTRY_POINT_NAME"]


def stats(model):
    """Per-layer counters (``moepage.Stats``) of every layer of ``model`` paged by this plugin."""
    from ...telemetry import Stats
    from .method import paged_methods

    return Stats((m.layer_key, m.pager.read_stats()) for m in paged_methods(model) if m.pager is not None)
