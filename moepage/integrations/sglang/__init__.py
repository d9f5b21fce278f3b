"""moepage's SGLang integration: page every ``FusedMoE`` layer of an SGLang server through
moepage's store, residency and executor.

    pip install moepage sglang==0.5.23
    python -m sglang.launch_server --model-path ... --enable-paged-experts \\
        --paged-experts-num-resident K|auto [--paged-experts-impl moepage|sglang]

Modules: ``plugin`` (entry point, hooks, CLI flags), ``method`` (the quant-method wrapper and
loaders into host rows), ``postload`` (the post-load step, repacks K experts at a time),
``runner`` (the SGLang runner contracts and final reductions), ``step`` (one paged step),
``checks`` (startup checks), ``prefetch`` (next-layer prefetch links), ``formats`` (supported
quantization formats), ``sizing`` (``auto`` K), ``graphs`` (CUDA-graph paths). Importing this
package does not import SGLang.
"""

from __future__ import annotations

from .plugin import ENTRY_POINT_GROUP, ENTRY_POINT_NAME, register

__all__ = ["register", "stats", "ENTRY_POINT_GROUP", "ENTRY_POINT_NAME"]


def stats(model):
    """Per-layer counters (``moepage.Stats``) of every layer of ``model`` paged by this plugin."""
    from ...wrap import Stats
    from .method import paged_methods

    return Stats((m.layer_key, m.paged.pager.stats) for m in paged_methods(model) if m.paged is not None)
