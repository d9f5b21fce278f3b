"""The vLLM plugin: vLLM calls ``register`` (entry point ``moepage`` of ``vllm.general_plugins``, unless
``VLLM_PLUGINS`` names other plugins only) in every process it starts, possibly more than once; it wraps
(``compat.HOOKS``):

- ``EngineArgs.add_cli_args``: moepage's flags (``settings.OPTIONS``) on vLLM's command line;
- ``EngineArgs.from_cli_args``: the flags given moved into ``additional_config["moepage"]``, which vLLM's config
  carries to every process;
- ``EngineArgs.create_engine_config``: the launch checked (``checks``) before any engine process starts;
- ``RoutedExperts._get_quant_method``: with moepage's options, every routed-experts layer's quant method wrapped by
  ``method.make`` (checked, paged); without them, vLLM's own;
- ``BaseModelLoader.load_model``: the loaded model's paged layers linked for next-layer prefetch (``prefetch``; none
  when it is off)."""

from __future__ import annotations

import functools

from .settings import KEY, OPTIONS

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "moepage"
_WRAPPED = "__moepage_wrapped__"


def add_cli_args(original, parser, *args, **kwargs):
    parser = original(parser, *args, **kwargs)
    from .compat import parser_actions

    have = {a.dest for a in parser_actions(parser)}
    group = parser.add_argument_group("moepage", "Paged experts (moepage): K of each MoE layer's experts on the GPU")
    for option in OPTIONS.values():
        if option.dest not in have:
            group.add_argument(option.flag, dest=option.dest, **{"default": None, **option.options})
    return parser


def from_cli_args(original, cls, args, *rest, **kwargs):
    engine_args = original(cls, args, *rest, **kwargs)
    given = {key: getattr(args, o.dest) for key, o in OPTIONS.items() if getattr(args, o.dest, None) is not None}
    if given:
        extra = dict(engine_args.additional_config or {})
        extra[KEY] = {**(extra.get(KEY) or {}), **given}
        engine_args.additional_config = extra
    return engine_args


def create_engine_config(original, self, *args, **kwargs):
    vllm_config = original(self, *args, **kwargs)
    from . import checks, compat
    from .settings import options

    chosen = options(compat.additional_config(vllm_config))
    if chosen:
        checks.check(compat.launch(vllm_config), chosen)
    return vllm_config


def get_quant_method(original, self, *args, **kwargs):
    base = original(self, *args, **kwargs)
    from .method import make

    return make(self, base)


def load_model(original, self, *args, **kwargs):
    model = original(self, *args, **kwargs)
    from .prefetch import link_model

    link_model(model)
    return model


def _wrap(owner, attr: str, hook) -> None:
    """``owner.attr`` replaced by ``hook(original, *args)``, kept a static or class method; once."""
    raw = owner.__dict__[attr]
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    fn = raw.__func__ if kind else raw
    if getattr(fn, _WRAPPED, False):
        return

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return hook(fn, *args, **kwargs)

    setattr(wrapped, _WRAPPED, True)
    setattr(owner, attr, kind(wrapped) if kind else wrapped)


HOOK_FUNCTIONS = {"add_cli_args": add_cli_args, "from_cli_args": from_cli_args,
                  "create_engine_config": create_engine_config, "get_quant_method": get_quant_method,
                  "load_model": load_model}


def register() -> None:
    """Entry point (``vllm.general_plugins``): wrap vLLM's functions (once per process; vLLM may call it again)."""
    from .compat import HOOKS

    for name, (owner, attr) in HOOKS.items():
        _wrap(owner, attr, HOOK_FUNCTIONS[name])
