"""Progress bars of long work (the CLI's commands, coding host rows at wrap): a ``progress(done, total)`` callback
drawing a tqdm bar on stderr where it is a terminal (or where asked), with a note after it where given; nothing without
tqdm, which the core does not require."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def progress(show: bool | None, desc: str, unit: str) -> Iterator[Callable[..., None] | None]:
    """A ``progress(done, total, note=None, title=None)`` callback drawing a bar on stderr (tqdm), titled ``desc`` (or
    ``title``, where given), ``note`` said after it: shown on a terminal, or where ``show`` forces it;
    None (nothing drawn) where ``show`` is False, off a terminal, or without tqdm."""
    if not (sys.stderr.isatty() if show is None else show):
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield None
        return
    bars = []  # made at the first report, when the total is known

    def update(done: int, total: int, note: str | None = None, title: str | None = None) -> None:
        if not bars:
            bars.append(tqdm(desc=f"moepage: {title or desc}", unit=unit, total=total, file=sys.stderr,
                             dynamic_ncols=True))
        elif title is not None:
            bars[0].set_description_str(f"moepage: {title}", refresh=False)
        bars[0].total = total
        if note is not None:
            bars[0].set_postfix_str(note, refresh=False)
        bars[0].update(done - bars[0].n)

    try:
        yield update
    finally:
        for bar in bars:
            bar.close()
