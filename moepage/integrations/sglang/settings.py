"""moepage's SGLang flags, a view of the engines' one table (``integrations.flags``): each kept on SGLang's server-args
record as a bookkeeping attribute (the record travels to the scheduler processes), else read from its ``MOEPAGE_*``
variable (``moepage.config.Setting``; the ``Engine`` API). A leaf: it imports nothing of the integration."""

from __future__ import annotations

from ...config import SGLANG
from ...errors import ConfigError
from ..flags import AUTO_K, ENGINES, IMPLS, OPTIONS, EngineOption, for_engine

__all__ = ["CPU_SHARE_WHERE", "ENABLE_HELP", "FLAGS", "IMPLS", "PREFETCH_WHERE", "RESIDENT_HELP", "Flag",
           "current_impl", "named", "setting"]


class Flag(EngineOption):
    """One of moepage's SGLang flags: the table's option, its argparse options and the variable that sets it."""

    @property
    def attr(self) -> str:
        """The bookkeeping attribute on the server-args record."""
        return "_moepage_" + self.dest


FLAGS: dict[str, Flag] = {o.dest: Flag.bound(o, SGLANG) for o in for_engine(SGLANG)}
# SGLang's own --paged-experts-num-resident takes auto with moepage: the end of its help.
RESIDENT_HELP = " With moepage (--paged-experts-impl moepage) it may be " + AUTO_K.format(**ENGINES[SGLANG]) + "."
ENABLE_HELP = (" That is SGLang's own implementation (--paged-experts-impl sglang). moepage's (--paged-experts-impl "
               "moepage) serves tensor and expert parallelism too; what it serves is checked at start-up and listed in "
               "moepage's docs/serving.md.")
PREFETCH_WHERE = OPTIONS["prefetch"].where(SGLANG)
CPU_SHARE_WHERE = OPTIONS["cpu_share"].where(SGLANG)


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
        raise ConfigError(f"{OPTIONS['impl'].where(SGLANG)}: {impl!r} is not one of {', '.join(IMPLS)}")
    return impl
