"""moepage's engine options, one table: each ``Option`` is one knob of the SGLang and vLLM plugins, its key (vLLM's
``additional_config["moepage"]`` key; the flag ``--paged-experts-<key>``), the one help text, its argparse options,
the ``MOEPAGE_*`` variable it falls back to and the engines it applies to. ``sglang.settings`` and ``vllm.settings``
are views of it; ``wrap`` documents the same knobs (tests/integrations/test_flags.py checks it). A leaf: it imports
nothing of the integrations."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..config import ENV, SGLANG, VLLM, Setting, checked, choice, parse_prefetch
from ..residency import DEFAULT_POLICY, policy_names

IMPLS = ("moepage", "sglang")  # SGLang's --paged-experts-impl: which implementation serves --enable-paged-experts

# What an engine's help says in its own words (``{name}`` in a help text).
ENGINES: Mapping[str, Mapping[str, str]] = MappingProxyType({
    SGLANG: MappingProxyType(dict(engine="SGLang", eager="--cuda-graph-backend-decode disabled",
                                  fraction="--mem-fraction-static")),
    VLLM: MappingProxyType(dict(engine="vLLM", eager="--enforce-eager", fraction="--gpu-memory-utilization")),
})
# K = auto, as both engines size it (``integrations.auto``); SGLang's own --paged-experts-num-resident help ends so.
AUTO_K = ("'auto': K from the GPU's memory x {fraction}, less a KV reserve (MOEPAGE_KV_RESERVE_FRACTION) and the "
          "non-expert weights, with the expert bytes from the checkpoint's safetensors headers; logged at startup")


def resident_arg(value: str) -> int | str:
    """argparse type of ``--paged-experts-num-resident``: a positive integer or ``auto``."""
    if value.strip().lower() == "auto":
        return "auto"
    try:
        k = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None
    if k < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {k}")
    return k


@dataclass(frozen=True)
class Option:
    """One engine option. ``help``: its text, ``{eager}``, ``{engine}`` and ``{fraction}`` (``ENGINES``) in each
    engine's words; ``values``: the values the help lists (``wrap``'s docstring lists them too); ``wrap``: the
    ``moepage.wrap`` keyword of the same knob (None: none)."""

    key: str
    help: str
    env: Setting | None = None
    args: Mapping[str, Any] = field(default_factory=dict)
    engines: tuple[str, ...] = (SGLANG, VLLM)
    values: tuple[str, ...] = ()
    wrap: str | None = None

    @property
    def flag(self) -> str:
        return "--paged-experts-" + self.key.replace("_", "-")

    @property
    def dest(self) -> str:
        return "paged_experts_" + self.key

    def env_for(self, engine: str) -> Setting | None:
        """The variable ``engine`` falls back to where the option is absent (None: none)."""
        return self.env if self.env is not None and engine in self.env.applies else None

    def help_for(self, engine: str) -> str:
        """The help text as ``engine``'s command line shows it, naming the variable it falls back to."""
        env = self.env_for(engine)
        return self.help.format(**ENGINES[engine]) + (f" Environment: {env.name}." if env is not None else "")

    def argparse_for(self, engine: str) -> dict[str, Any]:
        """``add_argument``'s keywords on ``engine``'s parser (besides the flag and its default)."""
        return {**self.args, "help": self.help_for(engine)}

    def where(self, engine: str) -> str:
        """How a message names the option: its flag, and the variable it falls back to."""
        env = self.env_for(engine)
        return self.flag if env is None else f"{self.flag} / {env.name}"


@dataclass(frozen=True)
class EngineOption:
    """An option as one engine's plugin has it (``bound``): the engines' settings modules hold these."""

    key: str
    flag: str
    dest: str
    env: Setting | None  # the variable this engine falls back to
    options: dict[str, Any]  # ``add_argument``'s keywords

    @classmethod
    def bound(cls, option: Option, engine: str) -> EngineOption:
        return cls(option.key, option.flag, option.dest, option.env_for(engine), option.argparse_for(engine))


def _or(values: tuple[str, ...]) -> str:
    return f"{', '.join(values[:-1])} or {values[-1]}"


_EAGER = "Steps are planned on the host: serve with {eager}."
POLICIES = tuple(policy_names().split(", "))

OPTIONS: dict[str, Option] = {o.key: o for o in (
    Option("impl", "Which implementation serves --enable-paged-experts: 'moepage' (default: the moepage plugin's "
           "store, residency and executor) or 'sglang' (SGLang's built-in paged experts), for side-by-side "
           "comparison.",
           Setting("MOEPAGE_SGLANG_IMPL", choice(*IMPLS), None, "which implementation serves --enable-paged-experts",
                   (SGLANG,)),
           dict(choices=IMPLS), engines=(SGLANG,)),
    # SGLang has --paged-experts-num-resident itself: its plugin takes auto there and adds AUTO_K to its help.
    Option("num_resident", "Page the routed experts of every MoE layer through moepage, keeping K of each layer's E "
           "experts in GPU memory (top_k <= K <= E) and the rest in pinned host memory; outputs are unchanged. "
           + AUTO_K + ". Same as additional_config {{\"moepage\": {{\"num_resident\": K}}}}.",
           args=dict(type=resident_arg, metavar="{K,auto}"), engines=(VLLM,), wrap="resident"),
    Option("policy", f"moepage's eviction policy: {_or(POLICIES)} (half-life H waves); default {DEFAULT_POLICY} "
           "(moepage.DEFAULT_POLICY).", ENV["MOEPAGE_POLICY"], values=POLICIES, wrap="policy"),
    Option("split", "moepage's per-layer slot budgets: a split file from `moepage plan --trace T --budget N --out "
           "FILE`. The total is --paged-experts-num-resident (or auto) times the MoE layers, re-split from the file's "
           "curves when it differs.", ENV["MOEPAGE_SPLIT"], dict(metavar="FILE"), wrap="resident"),
    Option("compress", "moepage keeps bf16 host rows losslessly coded (about 1.33x less pinned host memory) and "
           "decodes them into the slots at page-in; outputs are unchanged. Unquantized bf16 experts only. With "
           "--paged-experts-host-budget the rows are kept coded on disk too (fewer bytes read), coded once and kept "
           "for the next start.", ENV["MOEPAGE_COMPRESS"], dict(action="store_true"), wrap="compress"),
    Option("host_budget", "moepage's disk tier: keep H expert rows per layer (H >= K, or a byte size shared by the "
           "layers at the dtype they are served in, e.g. 64GiB) in host memory and the rest on disk, in "
           "--paged-experts-spill-dir; a budget holding every expert (H >= E) needs no disk tier and makes none. "
           + _EAGER, ENV["MOEPAGE_HOST_BUDGET"], dict(metavar="{H,BYTES}"), wrap="host_budget"),
    Option("spill_dir", "With --paged-experts-host-budget: where moepage keeps the expert rows on disk (rows "
           "{engine}'s loaders take unchanged from a local checkpoint are read where it holds them; the rest are "
           "written there as they load; kept for the next start of the same local checkpoint, each rank's own, else "
           "deleted at shutdown).", ENV["MOEPAGE_SPILL_DIR"], dict(metavar="DIR"), wrap="spill_dir"),
    Option("host_warm", "With --paged-experts-host-budget: a routing trace of this model (moepage record); each "
           "layer's host tier starts with the experts it routes to most, read from disk at startup.",
           ENV["MOEPAGE_HOST_WARM"], dict(metavar="TRACE"), wrap="host_warm"),
    Option("cpu_share", "moepage computes part of each eager step's missed experts on the CPU from their host rows "
           "while the others page in: 'auto' (a cost model measured at startup splits each step so both finish "
           "together, or not at all where it cannot win), a share in (0, 1] of the misses, or 'off' (default). Not "
           "bit-exact (the CPU's GEMMs round differently; docs/cpu-split.md). Unquantized SiLU-gated experts. "
           + _EAGER, ENV["MOEPAGE_CPU_SHARE"], dict(metavar="{off,auto,SHARE}"), wrap="cpu_share"),
    Option("prefetch", "moepage's next-layer prefetch: while a MoE layer runs, page in the experts the next layer's "
           "router predicts from this layer's input: 'off' (default), 'on' (router top_k per token) or an integer M "
           "(router top-M). Outputs are unchanged.",
           Setting("MOEPAGE_SGLANG_PREFETCH", checked(parse_prefetch, "a prefetch setting"), None,
                   "next-layer prefetch: off, on or M", (SGLANG,)),
           dict(metavar="{off,on,M}"), wrap="prefetch"),
)}


def for_engine(engine: str) -> list[Option]:
    """The options ``engine``'s plugin adds to its command line, in the table's order."""
    return [o for o in OPTIONS.values() if engine in o.engines]


def variables() -> dict[str, Setting]:
    """Every ``MOEPAGE_*`` variable: ``config.ENV``, then the options' own (the SGLang plugin's)."""
    return {**ENV, **{o.env.name: o.env for o in OPTIONS.values() if o.env is not None and o.env.name not in ENV}}
