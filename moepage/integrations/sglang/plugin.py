"""The SGLang plugin: entry point, hooks and CLI flags.

SGLang calls ``register`` for the ``sglang.srt.plugins`` entry point named ``moepage`` (unless
``SGLANG_PLUGINS`` names other plugins only) in every process it starts. It registers these hooks:

- after ``ServerArgs.add_cli_args``: adds ``--paged-experts-impl {moepage,sglang}``,
  ``--paged-experts-policy``, ``--paged-experts-split`` and ``--paged-experts-prefetch
  {off,on,M}``, and lets ``--paged-experts-num-resident`` take ``auto``;
- after ``ServerArgs.from_cli_args``: records those flags on the server-args record (bookkeeping
  attributes, which travel to the scheduler processes with the record; for the ``Engine`` API,
  ``MOEPAGE_SGLANG_IMPL``, ``MOEPAGE_POLICY``, ``MOEPAGE_SPLIT`` and ``MOEPAGE_SGLANG_PREFETCH``
  set them instead);
- around ``sglang.srt.layers.moe.paged_experts.make_for_layer`` (which ``FusedMoE.__init__``
  calls under ``--enable-paged-experts``): moepage's ``make_for_layer``, or SGLang's own when
  ``--paged-experts-impl sglang`` (or ``MOEPAGE_SGLANG_IMPL=sglang`` for the ``Engine`` API);
- after ``DefaultModelLoader.postprocess_weights``: links each paged layer to the next for
  next-layer prefetch (``prefetch.py``; nothing when ``--paged-experts-prefetch off``);
- only with ``MOEPAGE_STATS_PATH`` set: after the scheduler's ``flush_cache``, a stats dump
  (``dump.py``), for callers of an ``Engine`` whose model runs in another process.
"""

from __future__ import annotations

import argparse

from ..._env import env_str

ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "moepage"
IMPLS = ("moepage", "sglang")
IMPL_ATTR = "_moepage_paged_experts_impl"
IMPL_ENV = "MOEPAGE_SGLANG_IMPL"
POLICY_ATTR = "_moepage_paged_experts_policy"
POLICY_ENV = "MOEPAGE_POLICY"
SPLIT_ATTR = "_moepage_paged_experts_split"
SPLIT_ENV = "MOEPAGE_SPLIT"
PREFETCH_ATTR = "_moepage_paged_experts_prefetch"
PREFETCH_ENV = "MOEPAGE_SGLANG_PREFETCH"
# moepage's flags: the argparse dest -> the bookkeeping attribute keeping it on the server-args
# record (which travels to the scheduler processes) and the variable that sets it for ``Engine``.
FLAGS = {
    "paged_experts_impl": (IMPL_ATTR, IMPL_ENV),
    "paged_experts_policy": (POLICY_ATTR, POLICY_ENV),
    "paged_experts_split": (SPLIT_ATTR, SPLIT_ENV),
    "paged_experts_prefetch": (PREFETCH_ATTR, PREFETCH_ENV),
}

ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"
MAKE_FOR_LAYER = "sglang.srt.layers.moe.paged_experts.make_for_layer"
POSTPROCESS = "sglang.srt.model_loader.loader.DefaultModelLoader.postprocess_weights"


def resident_arg(value: str):
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


# moepage's own SGLang flags (added unless SGLang defines them): flag -> add_argument options.
OWN_FLAGS = {
    "--paged-experts-impl": dict(
        choices=IMPLS,
        help="Which implementation serves --enable-paged-experts: 'moepage' (default, the moepage plugin's "
        "store, residency and executor) or 'sglang' (SGLang's built-in paged experts), for side-by-side comparison.",
    ),
    "--paged-experts-policy": dict(
        help="moepage's eviction policy: lru, lfu, lfru, lfu:H or lfru:H (half-life H waves); default lfu "
        "(moepage.DEFAULT_POLICY). Environment: MOEPAGE_POLICY.",
    ),
    "--paged-experts-split": dict(
        metavar="FILE",
        help="moepage's per-layer slot budgets: a split file from `moepage plan --trace T --budget N --out FILE`. "
        "The total is --paged-experts-num-resident (or auto) times the MoE layers, re-split from the file's "
        "curves when it differs. Environment: MOEPAGE_SPLIT.",
    ),
    "--paged-experts-prefetch": dict(
        metavar="{off,on,M}",
        help="moepage's next-layer prefetch: while a MoE layer runs, page in the experts the next layer's router "
        "predicts from this layer's input. 'off' (default), 'on' (the router's top_k per token) or an integer M "
        "(router top-M). Outputs are unchanged. Environment: MOEPAGE_SGLANG_PREFETCH.",
    ),
}


def add_cli_args(result, parser: argparse.ArgumentParser, *args, **kwargs):
    """AFTER hook of ``ServerArgs.add_cli_args``."""
    for action in parser._actions:
        if action.dest == "paged_experts_num_resident":
            action.type = resident_arg
            action.metavar = "{K,auto}"
            action.help = (
                (action.help or "") + " With moepage (--paged-experts-impl moepage) it may be 'auto': "
                "K from the GPU budget (mem-fraction-static, a KV reserve and the expert bytes in "
                "the checkpoint's safetensors headers), logged at startup."
            )
    have = {a.dest for a in parser._actions}
    for flag, options in OWN_FLAGS.items():
        if flag.lstrip("-").replace("-", "_") not in have:  # SGLang may define it itself one day
            parser.add_argument(flag, default=None, **options)
    return result


def from_cli_args(record, cls, args, *rest, **kwargs):
    """AFTER hook of ``ServerArgs.from_cli_args``: keep moepage's flags on the record."""
    for dest, (attr, _) in FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            setattr(record, attr, value)
    return record


def setting(dest: str) -> str | None:
    """The value of moepage's flag ``dest``: the CLI flag, else its environment variable."""
    attr, env = FLAGS[dest]
    value = None
    try:
        from sglang.srt.runtime_context import get_server_args

        value = getattr(get_server_args(), attr, None)
    except Exception:  # no published record (unit tests, early startup)
        value = None
    return value or env_str(env)


def current_impl() -> str:
    """The implementation in effect: the CLI flag, else ``MOEPAGE_SGLANG_IMPL``, else moepage."""
    from ...errors import ConfigError

    impl = setting("paged_experts_impl") or "moepage"
    if impl not in IMPLS:
        raise ConfigError(f"--paged-experts-impl / {IMPL_ENV}: {impl!r} is not one of {', '.join(IMPLS)}")
    return impl


def make_for_layer(original, *args, **kwargs):
    """AROUND hook of SGLang's ``paged_experts.make_for_layer``."""
    if current_impl() == "sglang":
        return original(*args, **kwargs)
    from .method import make_for_layer as ours

    return ours(*args, **kwargs)


def after_postprocess(result, *args, **kwargs):
    """AFTER hook of ``DefaultModelLoader.postprocess_weights``: link the paged layers for prefetch."""
    from .prefetch import after_postprocess as link

    return link(result, *args, **kwargs)


_registered = False


def hooks() -> list[tuple[str, object, str]]:
    """(target, hook, hook type) of every hook ``register`` installs in this environment."""
    from . import dump

    out = [
        (ADD_CLI_ARGS, add_cli_args, "AFTER"),
        (FROM_CLI_ARGS, from_cli_args, "AFTER"),
        (MAKE_FOR_LAYER, make_for_layer, "AROUND"),
        (POSTPROCESS, after_postprocess, "AFTER"),
    ]
    if env_str(dump.PATH_ENV):
        out.append((dump.FLUSH_CACHE, dump.after_flush, "AFTER"))
    return out


def register() -> None:
    """Entry point (``sglang.srt.plugins``): register moepage's hooks with SGLang (once)."""
    global _registered
    if _registered:
        return
    _registered = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in hooks():
        HookRegistry.register(target, hook, HookType[kind])
