"""moepage's vLLM options: ``--paged-experts-*`` flags on vLLM's command line (the plugin adds them to vLLM's parser
and moves them into ``additional_config``), or the ``moepage`` entry of ``additional_config`` itself, as ``LLM(...)``
takes it: ``LLM(model, additional_config={"moepage": {"num_resident": 8}})``. vLLM sends its config to every process
it starts, so the options reach the workers that build the layers. Where an option is absent, its ``MOEPAGE_*``
variable (``moepage.config.ENV``). A leaf: it imports nothing of vLLM."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...config import ENV, Setting
from ...errors import ConfigError
from ..options import resident_arg

KEY = "moepage"  # the entry of vLLM's additional_config


@dataclass(frozen=True)
class Option:
    """One of moepage's vLLM options: its ``additional_config`` key, argparse options and variable."""

    key: str
    env: Setting | None
    options: dict

    @property
    def flag(self) -> str:
        return "--paged-experts-" + self.key.replace("_", "-")

    @property
    def dest(self) -> str:
        return "paged_experts_" + self.key


OPTIONS: dict[str, Option] = {o.key: o for o in (
    Option("num_resident", None,
           dict(type=resident_arg, metavar="K", help="Page the routed experts of every MoE layer through moepage, "
                "keeping K of each layer's E experts in GPU memory (top_k <= K <= E) and the rest in pinned host "
                "memory; outputs are unchanged. 'auto': K from the GPU's memory x --gpu-memory-utilization, less a "
                "KV reserve (MOEPAGE_KV_RESERVE_FRACTION) and the non-expert weights. Same as additional_config "
                "{\"moepage\": {\"num_resident\": K}}.")),
    Option("policy", ENV["MOEPAGE_POLICY"],
           dict(help="moepage's eviction policy: lru, lfu, lfru, lruf, lfu:H or lfru:H (half-life H waves); default "
                "lfu (moepage.DEFAULT_POLICY). Environment: MOEPAGE_POLICY.")),
    Option("split", ENV["MOEPAGE_SPLIT"],
           dict(metavar="FILE", help="moepage's per-layer slot budgets: a split file from `moepage plan --trace T "
                "--budget N --out FILE`, re-split to --paged-experts-num-resident times the MoE layers when its total "
                "differs. Environment: MOEPAGE_SPLIT.")),
    Option("compress", ENV["MOEPAGE_COMPRESS"],
           dict(action="store_true", default=None, help="moepage keeps bf16 host rows losslessly coded and decodes "
                "them into the slots at page-in; outputs are unchanged. With --paged-experts-host-budget the rows are "
                "kept coded on disk too (fewer bytes read), coded once and kept for the next start. Environment: "
                "MOEPAGE_COMPRESS.")),
    Option("host_budget", ENV["MOEPAGE_HOST_BUDGET"],
           dict(metavar="{H,BYTES}", help="moepage's disk tier: keep H expert rows per layer (H >= K, or a byte "
                "size shared by the layers at the dtype they are served in, e.g. 64GiB) in host memory and the "
                "rest on disk, in --paged-experts-spill-dir; a budget holding every expert (H >= E) needs no disk "
                "tier and makes none. Steps are planned on the host: serve with --enforce-eager. Environment: "
                "MOEPAGE_HOST_BUDGET.")),
    Option("spill_dir", ENV["MOEPAGE_SPILL_DIR"],
           dict(metavar="DIR", help="With --paged-experts-host-budget: where moepage keeps the expert rows on disk "
                "(rows vLLM's loader takes unchanged from a local checkpoint are read where it holds them; the rest "
                "are written there as it loads; kept for the next start of the same local checkpoint, each rank's own, "
                "else deleted at shutdown). Environment: MOEPAGE_SPILL_DIR.")),
    Option("host_warm", ENV["MOEPAGE_HOST_WARM"],
           dict(metavar="TRACE", help="With --paged-experts-host-budget: a routing trace of this model (moepage "
                "record); each layer's host tier starts with the experts it routes to most, read from disk at "
                "startup. Environment: MOEPAGE_HOST_WARM.")),
    Option("cpu_share", ENV["MOEPAGE_CPU_SHARE"],
           dict(metavar="{off,auto,SHARE}", help="moepage computes part of each step's missed experts on the CPU from "
                "their host rows while the others page in: 'auto' (a cost model measured at startup splits each step "
                "so both finish together, or not at all where it cannot win), a share in (0, 1] of the misses, or "
                "'off' (default). Not bit-exact (the CPU's GEMMs round differently; docs/cpu-split.md). Unquantized "
                "SiLU-gated experts; steps are planned on the host: serve with --enforce-eager. Environment: "
                "MOEPAGE_CPU_SHARE.")),
    Option("prefetch", None,
           dict(metavar="{off,on,M}", help="moepage's next-layer prefetch: while a MoE layer runs, page in the "
                "experts the next layer's router predicts from this layer's input: 'off' (default), 'on' (router "
                "top_k per token) or an integer M (router top-M). Outputs are unchanged.")),
)}
WHERE = "vLLM's additional_config['moepage'] / --paged-experts-*"


def options(additional_config: Any) -> dict[str, Any]:
    """moepage's options in vLLM's ``additional_config`` (``{}``: paging is off); an unknown key is refused."""
    if not isinstance(additional_config, Mapping):
        return {}
    chosen = additional_config.get(KEY)
    if chosen is None:
        return {}
    if not isinstance(chosen, Mapping):
        raise ConfigError(f"{WHERE}: expected a mapping of options ({', '.join(OPTIONS)}), got {chosen!r}")
    unknown = sorted(set(chosen) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"{WHERE}: unknown option(s) {', '.join(map(repr, unknown))}; the options are "
                          f"{', '.join(OPTIONS)}")
    return dict(chosen)


def setting(chosen: Mapping[str, Any], key: str) -> Any:
    """Option ``key``'s value: in ``chosen`` (``options``), else its variable."""
    value = chosen.get(key)
    if value is None and OPTIONS[key].env is not None:
        value = OPTIONS[key].env.read()
    return value


def named(chosen: Mapping[str, Any], key: str) -> str:
    """The name option ``key``'s value came by, for a message: its flag, or its variable where only that is set."""
    option = OPTIONS[key]
    return option.flag if chosen.get(key) is not None or option.env is None else option.env.name
