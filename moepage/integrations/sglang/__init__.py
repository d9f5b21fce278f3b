"""moepage's SGLang plugin: pages every ``FusedMoE`` layer of an SGLang server through moepage's store, residency
and executor. Importing this package does not import SGLang.

    pip install moepage sglang==0.5.23
    python -m sglang.launch_server --model-path ... --enable-paged-experts \\
        --paged-experts-num-resident K|auto [--paged-experts-impl moepage|sglang]
"""

from __future__ import annotations

from .plugin import ENTRY_POINT_GROUP, ENTRY_POINT_NAME, register

__all__ = ["register", "stats", "ENTRY_POINT_GROUP", "ENTRY_POINT_NAME"]


def stats(model):
    """Per-layer counters (``moepage.Stats``) of every layer of ``model`` paged by this plugin."""
    from ...telemetry import Stats
    from .method import paged_methods

    return Stats((m.layer_key, m.pager.read_stats()) for m in paged_methods(model) if m.pager is not None)
