"""moepage's SGLang integration: page every ``FusedMoE`` layer of an SGLang server through
moepage's store, residency and executor.

    pip install moepage sglang==0.5.23
    python -m sglang.launch_server --model-path ... --enable-paged-experts \\
        --paged-experts-num-resident K|auto [--paged-experts-impl moepage|sglang]

Modules: ``plugin`` (entry point, hooks), ``settings`` (moepage's flags and variables, a leaf),
``compat`` (every reach into SGLang's internals, and the parts of its own paged experts composed),
``method`` (the quant-method wrapper and loaders into host rows), ``postload`` (the post-load step,
repacks K experts at a time), ``contracts`` (runner contracts and the step's wave runner),
``checks`` (startup checks), ``prefetch`` (next-layer prefetch links), ``sizing`` (``auto`` K),
``session`` (what the process's paged layers share), ``dump`` (a stats file for ``Engine``
callers). Importing this package does not import SGLang.
"""

from __future__ import annotations

from .plugin import ENTRY_POINT_GROUP, ENTRY_POINT_NAME, register

__all__ = ["register", "stats", "ENTRY_POINT_GROUP", "ENTRY_POINT_NAME"]


def stats(model):
    """Per-layer counters (``moepage.Stats``) of every layer of ``model`` paged by this plugin."""
    from ...telemetry import Stats
    from .method import paged_methods

    return Stats((m.layer_key, m.pager.read_stats()) for m in paged_methods(model) if m.pager is not None)
