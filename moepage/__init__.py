"""moepage: page the routed experts of a Mixture-of-Experts model between host memory and a
K-slot table on the accelerator, with outputs equal to the unpaged model's.

    import moepage
    moepage.wrap(model, resident=K)      # page every experts module of the model
    moepage.stats(model)                 # per-layer hits, misses, bytes paged, waves
"""

from .errors import ConfigError, MoepageError, PageInError, VerifyError
from .executor import PagedLayer
from .pager import LayerPager, PagerOptions, capture_mode
from .prefetch import Predictor, RouterPredictor
from .telemetry import LayerStats
from .residency import DEFAULT_POLICY, Policy, Residency, Wave, plan_waves
from .runners import ExpertOrder, Runner, TopkSum, register_resolver, register_runner
from .store import PagedExpertStore, RowSpec, StoreCounters, host_row
from .wrap import Stats, find_experts, paged_layers, stats, unwrap, wrap

__version__ = "0.1.0"

__all__ = [
    "wrap", "unwrap", "stats", "capture_mode", "Stats", "LayerStats", "find_experts", "paged_layers",
    "PagedExpertStore", "RowSpec", "StoreCounters", "host_row",
    "Residency", "Policy", "DEFAULT_POLICY", "Wave", "plan_waves", "PagedLayer", "LayerPager", "PagerOptions",
    "Predictor", "RouterPredictor",
    "Runner", "TopkSum", "ExpertOrder", "register_runner", "register_resolver",
    "MoepageError", "ConfigError", "PageInError", "VerifyError",
]
