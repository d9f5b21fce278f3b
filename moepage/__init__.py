"""moepage: page the routed experts of a Mixture-of-Experts model between host memory and a
K-slot table on the accelerator, with outputs equal to the unpaged model's.

    import moepage
    moepage.wrap(model, resident=K)      # page every experts module of the model
    moepage.stats(model)                 # per-layer hits, misses, bytes paged, waves
    moepage.wrap(model, resident=K, compress=True)   # host rows coded losslessly (bf16, ~1.33x)

The core, in the order a step reads it: ``step`` (the whole paged step of every adapter), ``pager`` (one layer's
state, on the host and the device), ``residency`` (the eviction rule: one ``Policy`` description every planner reads),
``backends`` (the store protocol, ``backends.protocol``, and its implementations), ``kernels`` (the device planner,
gather and unpacking). Around it: ``config`` (every knob, validated once), ``lifetime`` (``page_layer``: rows, codes,
slots, pager, for every adapter), ``contract`` (how a module's computation runs over slot ids), ``compress``,
``prefetch``, ``telemetry``, ``capture``, ``split`` and ``cpu`` (a step's misses split between the link and the
CPU: ``cpu_share``, off by default).
Adapters: ``nn`` (stacked-experts torch modules), ``integrations`` (transformers, SGLang).
Offline tools: ``planning`` (traces, synthetic routing, budgets, sizing), the ``moepage`` CLI.
"""

import warnings as _warnings

with _warnings.catch_warnings():
    # torch warns at import when numpy is missing; moepage's base install (and its CLI) needs no numpy.
    _warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch as _torch  # noqa: F401

from .backends.protocol import HostBytes, PagedExpertStore, RowSpec, host_row
from .capture import capture_mode
from .config import PagingConfig
from .contract import (
    CpuExpert,
    ExpertOrder,
    Runner,
    TopkSum,
    register_cpu_expert,
    register_diagnosis,
    register_resolver,
    register_runner,
)
from .errors import ConfigError, DamagedRowsError, MoepageError, PageInError, VerifyError
from .nn import PagedLayer, find_experts, host_bytes, paged_layers, stats, unwrap, wrap
from .pager import LayerPager
from .prefetch import Predictor, RouterPredictor
from .residency import DEFAULT_POLICY, Policy, Residency, Wave, plan_waves
from .telemetry import LayerStats, Stats

__version__ = "0.3.0"

__all__ = [
    "wrap", "unwrap", "stats", "host_bytes", "capture_mode", "Stats", "LayerStats", "find_experts", "paged_layers",
    "PagedExpertStore", "RowSpec", "HostBytes", "host_row", "PagingConfig",
    "Residency", "Policy", "DEFAULT_POLICY", "Wave", "plan_waves", "PagedLayer", "LayerPager",
    "Predictor", "RouterPredictor",
    "Runner", "TopkSum", "ExpertOrder", "register_runner", "register_resolver", "register_diagnosis",
    "CpuExpert", "register_cpu_expert",
    "MoepageError", "ConfigError", "PageInError", "DamagedRowsError", "VerifyError",
]
