"""moepage's SGLang flags: each kept on SGLang's server-args record as a bookkeeping attribute (the record travels to
the scheduler processes), else read from its ``MOEPAGE_*`` variable (``moepage.config.Setting``; the ``Engine`` API).
A leaf: it imports nothing of the integration."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import ENV, SGLANG, Setting, checked, choice, parse_prefetch
from ...errors import ConfigError

IMPLS = ("moepage", "sglang")


@dataclass(frozen=True)
class Flag:
    """One of moepage's SGLang flags: its argparse options and the variable that sets it."""

    flag: str
    attr: str  # the bookkeeping attribute on the server-args record
    env: Setting
    options: dict

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


FLAGS: dict[str, Flag] = {f.dest: f for f in (
    Flag("--paged-experts-impl", "_moepage_paged_experts_impl",
         Setting("MOEPAGE_SGLANG_IMPL", choice(*IMPLS), None, "which implementation serves --enable-paged-experts",
                 (SGLANG,)),
         dict(choices=IMPLS, help="Which implementation serves --enable-paged-experts: 'moepage' (default: the moepage "
              "plugin's store, residency and executor) or 'sglang' (SGLang's built-in paged experts), for side-by-side "
              "comparison. Environment: MOEPAGE_SGLANG_IMPL.")),
    Flag("--paged-experts-policy", "_moepage_paged_experts_policy", ENV["MOEPAGE_POLICY"],
         dict(help="moepage's eviction policy: lru, lfu, lfru, lfu:H or lfru:H (half-life H waves); default lfu "
              "(moepage.DEFAULT_POLICY). Environment: MOEPAGE_POLICY.")),
    Flag("--paged-experts-split", "_moepage_paged_experts_split", ENV["MOEPAGE_SPLIT"],
         dict(metavar="FILE", help="moepage's per-layer slot budgets: a split file from `moepage plan --trace T "
              "--budget N --out FILE`. The total is --paged-experts-num-resident (or auto) times the MoE layers, "
              "re-split from the file's curves when it differs. Environment: MOEPAGE_SPLIT.")),
    Flag("--paged-experts-compress", "_moepage_paged_experts_compress", ENV["MOEPAGE_COMPRESS"],
         dict(action="store_true", help="moepage keeps bf16 host rows losslessly coded (about 1.33x less pinned host "
              "memory) and decodes them into the slots at page-in; outputs are unchanged. Unquantized bf16 experts "
              "only. With --paged-experts-host-budget the rows are kept coded on disk too (fewer bytes read), coded "
              "once and kept for the next start. Environment: MOEPAGE_COMPRESS.")),
    Flag("--paged-experts-host-budget", "_moepage_paged_experts_host_budget", ENV["MOEPAGE_HOST_BUDGET"],
         dict(metavar="{H,BYTES}", help="moepage's disk tier: keep H expert rows per layer (H >= K, or a byte "
              "size shared by the layers at the dtype they are served in, e.g. 64GiB) in host memory and the "
              "rest on disk, in --paged-experts-spill-dir; a budget holding every expert (H >= E) needs no disk tier "
              "and makes none. Steps are planned on the host: serve with --cuda-graph-backend-decode disabled. "
              "Environment: MOEPAGE_HOST_BUDGET.")),
    Flag("--paged-experts-spill-dir", "_moepage_paged_experts_spill_dir", ENV["MOEPAGE_SPILL_DIR"],
         dict(metavar="DIR", help="With --paged-experts-host-budget: where moepage keeps the expert rows on disk "
              "(rows SGLang's loaders take unchanged from a local checkpoint are read where it holds them; the rest "
              "are written there as they load; kept for the next start of the same local checkpoint, each rank's own, "
              "else deleted at shutdown). Environment: MOEPAGE_SPILL_DIR.")),
    Flag("--paged-experts-host-warm", "_moepage_paged_experts_host_warm", ENV["MOEPAGE_HOST_WARM"],
         dict(metavar="TRACE", help="With --paged-experts-host-budget: a routing trace of this model (moepage "
              "record); each layer's host tier starts with the experts it routes to most, read from disk at "
              "startup. Environment: MOEPAGE_HOST_WARM.")),
    Flag("--paged-experts-cpu-share", "_moepage_paged_experts_cpu_share", ENV["MOEPAGE_CPU_SHARE"],
         dict(metavar="{off,auto,SHARE}", help="moepage computes part of each eager step's missed experts on the CPU "
              "from their host rows while the others page in: 'auto' (a cost model measured at startup splits each "
              "step so both finish together, or not at all where it cannot win), a share in (0, 1] of the misses, or "
              "'off' (default). Not bit-exact (the CPU's GEMMs round differently; docs/cpu-split.md). Unquantized "
              "SiLU-gated experts; eager decode (--cuda-graph-backend-decode disabled). Environment: "
              "MOEPAGE_CPU_SHARE.")),
    Flag("--paged-experts-prefetch", "_moepage_paged_experts_prefetch",
         Setting("MOEPAGE_SGLANG_PREFETCH", checked(parse_prefetch, "a prefetch setting"), None,
                 "next-layer prefetch: off, on or M", (SGLANG,)),
         dict(metavar="{off,on,M}", help="moepage's next-layer prefetch: while a MoE layer runs, page in the experts "
              "the next layer's router predicts from this layer's input: 'off' (default), 'on' (router top_k per "
              "token) or an integer M (router top-M). Outputs are unchanged. Environment: MOEPAGE_SGLANG_PREFETCH.")),
)}
RESIDENT_HELP = (" With moepage (--paged-experts-impl moepage) it may be 'auto': K from the GPU budget "
                 "(mem-fraction-static, a KV reserve and the expert bytes in the checkpoint's safetensors "
                 "headers), logged at startup.")
PREFETCH_WHERE = "--paged-experts-prefetch / MOEPAGE_SGLANG_PREFETCH"
CPU_SHARE_WHERE = "--paged-experts-cpu-share / MOEPAGE_CPU_SHARE"


def _published(record):
    """``record``, else the server-args record SGLang published (None where there is none)."""
    if record is None:
        try:
            from sglang.srt.runtime_context import get_server_args

            record = get_server_args()
        except Exception:  # no published record (unit tests, early startup)
            record = None
    return record


def setting(dest: str, record=None) -> str | None:
    """Flag ``dest``'s value: on the server-args ``record`` (default: the one SGLang published), else its variable."""
    flag = FLAGS[dest]
    return getattr(_published(record), flag.attr, None) or flag.env.read()


def named(dest: str, record=None) -> str:
    """The name ``dest``'s value came by, for a message: its flag, or its variable where only that is set."""
    flag = FLAGS[dest]
    return flag.flag if getattr(_published(record), flag.attr, None) else flag.env.name


def current_impl() -> str:
    """The implementation in effect: the CLI flag, else ``MOEPAGE_SGLANG_IMPL``, else moepage."""
    impl = setting("paged_experts_impl") or "moepage"
    if impl not in IMPLS:
        raise ConfigError(f"--paged-experts-impl / MOEPAGE_SGLANG_IMPL: {impl!r} is not one of {', '.join(IMPLS)}")
    return impl
