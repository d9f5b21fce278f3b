"""Reading moepage's ``MOEPAGE_*`` environment variables: every one is read through here.

An unset or empty variable gives the default; a value that cannot be read raises ``ConfigError``
naming the variable, the value and what is allowed (never a bare ``ValueError`` from ``int()``).
"""

from __future__ import annotations

import os
from typing import Callable, Sequence, TypeVar

from .errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
T = TypeVar("T", int, float)


def env_str(name: str, default: str | None = None, choices: Sequence[str] | None = None) -> str | None:
    """The variable's text, stripped; ``default`` when unset or empty. With ``choices``, one of them."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if choices is not None and value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(choices)}; set one of them or unset it")
    return value


def env_flag(name: str, default: bool | None = False) -> bool | None:
    """1/0, true/false, yes/no, on/off (any case); ``default`` when unset or empty."""
    value = env_str(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is not a flag; set it to 1/0, true/false, yes/no or on/off, or unset it")


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    """A whole number, at least ``minimum``; ``default`` when unset or empty."""
    at_least = f" >= {minimum}" if minimum is not None else ""
    return _number(name, int, default, lambda n: minimum is None or n >= minimum, f"a whole number{at_least}")


def env_float(name: str, default: float, minimum: float, below: float) -> float:
    """A number in ``[minimum, below)``; ``default`` when unset or empty."""
    return _number(name, float, default, lambda x: minimum <= x < below, f"a number in [{minimum:g}, {below:g})")


def _number(name: str, kind: Callable[[str], T], default: T, ok: Callable[[T], bool], allowed: str) -> T:
    value = env_str(name)
    if value is None:
        return default
    try:
        number = kind(value)
    except ValueError:
        number = None
    if number is None or not ok(number):
        raise ConfigError(f"{name}={value!r} is not {allowed}; set one or unset it")
    return number
