"""The manifest of a spill folder: the layouts of expert rows on disk that earlier loads kept there, one per source
(what the rows were made from, as a dict; its ``files``, ``{path: [size, mtime_ns, inode]}``, the files they were read
from), so a restart reuses its rows instead of writing them again.

Loads of different sources share a folder without orphaning each other's files; a layout whose files changed (its
checkpoint rewritten, a file removed) is dropped, with the spill files only it named; two loads of one source at once
keep the first layout saved (the other load's file goes with its store). Writers take a lock on the folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from .disk import DiskRows, Identity, OsFile, RowFile, written_here

MANIFEST = "manifest.json"
VERSION = 2  # {"version": 2, "layouts": [DiskRows.manifest(...), ...]}; version 1 was one layout alone


def find(folder: str, source: dict, opener: Callable[[str], RowFile] = OsFile) -> DiskRows | None:
    """The rows an earlier load of ``source`` kept in ``folder``, its files as they were; None if none."""
    for layout in _layouts(Path(folder)):
        if (found := DiskRows.from_manifest(layout, source, opener)) is not None:
            return found
    return None


def keep(folder: str, layout: dict, source: dict) -> bool:
    """Save ``layout`` (``DiskRows.manifest``, of sealed rows) as ``source``'s in ``folder``, dropping layouts whose
    files changed and deleting the files of this folder only they named; False where a layout of ``source`` is there
    already (kept meanwhile by another load): the caller's own files then stay its own."""
    path = Path(folder)
    with _locked(path):
        layouts = [x for x in _layouts(path) if _current(x)]
        if any(x.get("source") == source for x in layouts):
            return False
        layouts.append(layout)
        named = {f[0] for x in layouts for f in x["files"]}
        for old in _layouts(path):
            for f in old.get("files", []):
                if f[0] not in named and written_here(f[0], folder):  # never a checkpoint's file
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(f[0])
        tmp = path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps({"version": VERSION, "layouts": layouts}))
        os.replace(tmp, path / MANIFEST)
    return True


def _layouts(folder: Path) -> list[dict]:
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict):
        return []
    if data.get("version") == VERSION:
        return [x for x in data.get("layouts", []) if isinstance(x, dict)]
    return [data]  # one layout alone, as version 1 saved it


def _current(layout: dict) -> bool:
    """Every file of ``layout``, and every file its source names (``source["files"]``: ``{path: [size, mtime_ns,
    inode]}``, a checkpoint's files the rows were made from), is as it was when the layout was saved."""
    try:
        files = [*layout["files"], *([p, *x] for p, x in layout["source"].get("files", {}).items())]
        return all(Identity.of(p) == Identity(size, mtime, inode) for p, size, mtime, inode in files)
    except (OSError, KeyError, TypeError, ValueError, AttributeError):
        return False


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
