"""Deprecated: moved to ``moepage.planning.budgets`` (``load_split`` and the rest)."""

import warnings

from .planning.budgets import *  # noqa: F401,F403
from .planning.budgets import load_split  # noqa: F401

warnings.warn("moepage.budgets moved to moepage.planning.budgets", DeprecationWarning, stacklevel=2)
