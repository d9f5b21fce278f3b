"""moepage's vLLM options: ``--paged-experts-*`` flags on vLLM's command line (the plugin adds them to vLLM's parser
and moves them into ``additional_config``), or the ``moepage`` entry of ``additional_config`` itself, as ``LLM(...)``
takes it: ``LLM(model, additional_config={"moepage": {"num_resident": 8}})``. vLLM sends its config to every process
it starts, so the options reach the workers that build the layers. Where an option is absent, its ``MOEPAGE_*``
variable (``moepage.config.ENV``). A view of the engines' one table (``integrations.flags``); a leaf: it imports
nothing of vLLM."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...config import VLLM
from ...errors import ConfigError
from ..flags import EngineOption as Option
from ..flags import for_engine

KEY = "moepage"  # the entry of vLLM's additional_config
OPTIONS: dict[str, Option] = {o.key: Option.bound(o, VLLM) for o in for_engine(VLLM)}
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
