"""The SGLang plugin: SGLang calls ``register`` (entry point ``moepage`` of ``sglang.srt.plugins``, unless
``SGLANG_PLUGINS`` names other plugins only) in every process it starts. Its hooks:

- after ``ServerArgs.add_cli_args``: moepage's flags (``settings.FLAGS``, the engines' one table's); SGLang's own
  ``--paged-experts-num-resident`` takes auto;
- after ``ServerArgs.from_cli_args``: the flags kept on the server-args record, which reaches the scheduler processes;
- around ``paged_experts.make_for_layer`` (``FusedMoE.__init__`` calls it under ``--enable-paged-experts``): moepage's,
  or SGLang's own for ``--paged-experts-impl sglang`` / ``MOEPAGE_SGLANG_IMPL=sglang``;
- after ``DefaultModelLoader.postprocess_weights`` and ``DummyModelLoader.load_model`` (``--load-format dummy``, which
  never calls the former): next-layer prefetch links (``prefetch``; none when off);
- after ``Scheduler.flush_cache``, if ``MOEPAGE_STATS_PATH`` is set: a stats dump (``dump``) for ``Engine`` callers."""

from __future__ import annotations

import argparse

from ...config import env
from ..flags import OPTIONS, resident_arg
from .settings import ENABLE_HELP, FLAGS, RESIDENT_HELP, current_impl

ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "moepage"
ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"
MAKE_FOR_LAYER = "sglang.srt.layers.moe.paged_experts.make_for_layer"
POSTPROCESS = "sglang.srt.model_loader.loader.DefaultModelLoader.postprocess_weights"
DUMMY_LOAD = "sglang.srt.model_loader.loader.DummyModelLoader.load_model"
FLUSH_CACHE = "sglang.srt.managers.scheduler.Scheduler.flush_cache"


def add_cli_args(result, parser: argparse.ArgumentParser, *args, **kwargs):
    """AFTER hook of ``ServerArgs.add_cli_args``."""
    from .compat import argparse_actions

    for action in argparse_actions(parser):
        if action.dest == "paged_experts_num_resident":
            action.type, action.metavar = resident_arg, OPTIONS["num_resident"].args["metavar"]
            action.help = (action.help or "") + RESIDENT_HELP
        elif action.dest == "enable_paged_experts":  # its text describes SGLang's implementation only
            action.help = (action.help or "") + ENABLE_HELP
    have = {a.dest for a in argparse_actions(parser)}
    for flag in FLAGS.values():
        if flag.dest not in have:  # SGLang may define it itself one day
            parser.add_argument(flag.flag, default=None, **flag.options)
    return result


def from_cli_args(record, cls, args, *rest, **kwargs):
    """AFTER hook of ``ServerArgs.from_cli_args``: keep moepage's flags on the record."""
    for dest, flag in FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            setattr(record, flag.attr, value)
    return record


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


def after_dummy_load(model, *args, **kwargs):
    """AFTER hook of ``DummyModelLoader.load_model``: link the loaded model's paged layers for prefetch."""
    from .prefetch import link_model

    link_model(model)
    return model


_registered = False


def hooks() -> list[tuple[str, object, str]]:
    """(target, hook, hook type) of every hook ``register`` installs in this environment."""
    from . import dump

    out = [
        (ADD_CLI_ARGS, add_cli_args, "AFTER"),
        (FROM_CLI_ARGS, from_cli_args, "AFTER"),
        (MAKE_FOR_LAYER, make_for_layer, "AROUND"),
        (POSTPROCESS, after_postprocess, "AFTER"),
        (DUMMY_LOAD, after_dummy_load, "AFTER"),
    ]
    if env("MOEPAGE_STATS_PATH"):
        out.append((FLUSH_CACHE, dump.after_flush, "AFTER"))
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
