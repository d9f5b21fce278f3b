"""Reading moepage's environment variables: one parser for each kind, errors naming the variable."""

from __future__ import annotations

import os

from .errors import ConfigError

_TRUE = ("1", "true", "yes", "on", "y")
_FALSE = ("0", "false", "no", "off", "n", "")


def env_flag(name: str, default: bool = False) -> bool:
    """A boolean variable: 1/0, true/false, yes/no, on/off (any case); unset: ``default``."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    """An integer variable (at least ``minimum``); unset or empty: ``default``."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={raw!r} must be at least {minimum}")
    return value
