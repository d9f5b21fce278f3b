"""``wrap``'s ``resident``: one K for every layer, a ``{layer: K}`` split or a split file's path, read into each layer's
K (``slot_counts``) with what is wrong said to ``config.Problems``. A split whose keys do not fit the layers is said
once the layers are planned (``Unmatched``), so that a split file of another model can say how its E and top_k
differ from this one's."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..config import Problems, listed, slot_count, split_k
from ..errors import ConfigError
from .find import LayerPlan


@dataclass(frozen=True)
class Unmatched:
    """A split whose ``unknown`` keys name no layer and whose ``missing`` layers have no K; from a split file
    (``path``), with the E and top_k it was planned for (``routing``: None where it does not say)."""

    names: list[str]
    unknown: list
    missing: list[str]
    path: str | None = None
    routing: tuple[int | None, int | None] = (None, None)

    def text(self, plans: Sequence[LayerPlan]) -> str:
        """The problem, naming only the parts that are wrong; a file's keys or routing that are not this model's
        say that it looks like a split of another model (``plans``: the layers' E and top_k, where planned)."""
        wrong = []
        if self.unknown:
            wrong.append(f"keys {_quoted(self.unknown)} name no experts module of this model")
        if len(self.missing) == len(self.names):
            wrong.append("no layer has a K")
        elif self.missing:
            wrong.append(f"{'layer' if len(self.missing) == 1 else 'layers'} {_quoted(self.missing)} "
                         f"{'has' if len(self.missing) == 1 else 'have'} no K")
        where = "resident split" if self.path is None else f"resident={self.path!r} (a split file)"
        text = f"{where}: {' and '.join(wrong)}"
        other = self._routing_difference(plans)
        if self.path is not None and (self.unknown or other):
            text += "; it looks like a split of another model" + (f": it was planned for {other}" if other else "")
        return f"{text}; the layers are {_quoted(self.names)} (or their indices 0..{len(self.names) - 1})"

    def _routing_difference(self, plans: Sequence[LayerPlan]) -> str:
        """How the file's E and top_k differ from this model's (its first layer's, as ``host_warm`` compares)."""
        if not plans:
            return ""
        ours = (plans[0].num_experts, plans[0].top_k)
        said = [f"{what}={theirs}{unit}, not {mine}" for what, unit, theirs, mine
                in zip(("E", "top_k"), (" experts", ""), self.routing, ours)
                if theirs is not None and mine is not None and theirs != mine]
        return ", and ".join(said)


def _quoted(items: Sequence[object]) -> str:
    return listed([repr(x) for x in items], 4)


def slot_counts(resident: object, names: list[str], problems: Problems) -> tuple[list[int] | None, Unmatched | None]:
    """K of every layer in ``names`` from ``resident``: one integer for all, a ``{layer: K}`` split (keys: module
    names, or a layer's index among the experts modules), or a split file's path. None where it cannot be read: the
    problem is said to ``problems``, or, where the split's keys do not fit the layers, returned to be said once the
    layers are planned."""
    path, routing = None, (None, None)
    if isinstance(resident, (str, os.PathLike)):
        path = os.fspath(resident)
        read = _read_split_file(resident, problems)
        if read is None:
            return None, None
        resident, routing = read
    if not isinstance(resident, Mapping):
        try:
            return [slot_count(resident)] * len(names), None
        except ConfigError as exc:
            problems.add(str(exc))
            return None, None
    twice = [f"{n!r} (also as {i})" for i, n in enumerate(names) if n in resident and i in resident]
    if twice:
        problems.add(f"resident split: names layers twice, by name and by index: {', '.join(twice)}; give each "
                     "layer one K")
        return None, None
    known = set(names) | set(range(len(names)))
    unknown = [key for key in resident if key not in known]
    missing = [n for i, n in enumerate(names) if split_k(resident, i, n) is None]
    if unknown or missing:
        return None, Unmatched(names, unknown, missing, path, routing)
    try:
        return [slot_count(split_k(resident, i, n), f"resident[{n!r}]") for i, n in enumerate(names)], None
    except ConfigError as exc:
        problems.add(str(exc))
        return None, None


def _read_split_file(path: str | os.PathLike, problems: Problems
                     ) -> tuple[dict[int | str, int], tuple[int | None, int | None]] | None:
    """The split file's ``{layer: K}`` and the E and top_k it was planned for, or None (said to ``problems``): a
    string that is no file but a number was meant as K."""
    from ..planning.budgets import load_split, split_routing

    if isinstance(path, str) and not os.path.exists(path) and re.fullmatch(r"[+-]?[0-9]+(\.[0-9]*)?", path.strip()):
        example = int(path) if path.strip().isdigit() else 4
        problems.add(f"resident={path!r} is a string, read as a split file's path, and there is no such file; K must "
                     f"be an int (e.g. resident={example})")
        return None
    try:
        return load_split(path), split_routing(path)
    except ConfigError as exc:  # it names the file
        problems.add(f"resident: {exc}")
        return None
