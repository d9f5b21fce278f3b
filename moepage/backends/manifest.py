"""The manifest of a spill folder: the layouts of expert rows on disk that earlier loads kept there, one per source
(what the rows were made from, as a dict; its ``files``, ``{real path: identity record}``, the files they were read
from), so a restart reuses its rows instead of writing them again.

Loads of different sources share a folder without orphaning each other's files. A layout whose files changed (its
checkpoint rewritten, a file removed) is dropped when the next layout is saved, and its files of rows with it once no
process holds them (``folder``); files no layout names and no process holds (a killed process's, a manifest that could
not be read) are swept then too. Two loads of one source at once keep the first layout saved; the other load's files
go with its store. A checkpoint file whose rows, read in place, failed their checksums with its identity unchanged is
remembered (``note_damaged``: its rows' spans and checksums) until its identity changes, so a later load does not lay
its changed bytes out as if they were the checkpoint's (``damaged``). Everything here runs under the folder's lock.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from . import folder as rows_folder
from .disk import DiskRows, Extent, Identity, OsFile, RowFile
from .protocol import RowSpec

MANIFEST = rows_folder.MANIFEST
VERSION = 2  # {"version": 2, "layouts": [DiskRows.manifest(...), ...]}; version 1 was one layout alone


def find(folder: str, source: dict, opener: Callable[[str], RowFile] = OsFile, hold: bool = True) -> DiskRows | None:
    """The rows an earlier load of ``source`` kept in ``folder``, its files as they were (``hold``: each held for the
    caller, who releases it when done); None if none."""
    if not os.path.isdir(folder):
        return None
    with rows_folder.locked(folder):
        layouts = _layouts(folder)
        rows_folder.sweep(folder, _named(layouts))
        for layout in layouts:
            if (found := DiskRows.from_manifest(layout, source, opener)) is not None:
                for path in found.identity if hold else ():
                    if rows_folder.ours(path, folder):
                        rows_folder.hold(path)
                return found
    return None


def find_fitting(folder: str, source: dict, specs: Mapping[str, Mapping[str, RowSpec]]) -> DiskRows | None:
    """The layout ``find`` gives (not held) where it lays out every row of ``specs`` (layer -> tensor -> its spec as
    loaded) whole, each of the bytes its code there gives (raw without one); one that does not (damaged, or written
    by a version that kept them otherwise) is dropped, so the load lays them out anew. None where there is none."""
    found = find(folder, source, hold=False)
    if found is None:
        return None
    if not all(found.serves((layer, name), replace(spec, code=found.codes.get((layer, name))))
               for layer, tensors in specs.items() for name, spec in tensors.items()):
        drop(folder, source)
        return None
    return found


def keep(folder: str, layout: dict, source: dict) -> bool:
    """Save ``layout`` (``DiskRows.manifest``, of sealed rows) as ``source``'s in ``folder``, dropping layouts whose
    files changed; False where a layout of ``source`` is there already (kept meanwhile by another load): the caller's
    own files then stay its own."""
    with rows_folder.locked(folder):
        layouts = [x for x in _layouts(folder) if _current(x) and _parsed(x)]
        if any(x.get("source") == source for x in layouts):
            return False
        _save(folder, [*layouts, layout])
    return True


def drop(folder: str, source: dict) -> None:
    """Forget ``source``'s layout (its rows found damaged), its files with it once no process holds them."""
    with rows_folder.locked(folder):
        _save(folder, [x for x in _layouts(folder) if x.get("source") != source])


def note_damaged(folder: str, path: str, identity: Identity, extents: Iterable[Extent]) -> None:
    """Remember in ``folder`` that ``path``, a checkpoint's file read in place, failed the checksums its rows were laid
    out with (``extents``) while its identity stayed ``identity``: its bytes changed on disk. A later load reading
    rows from it as it is (``damaged``) takes only the bytes those rows were laid out from."""
    with rows_folder.locked(folder):
        damaged = _damaged(folder)
        spans = {(o, n): c for o, n, c in damaged.get(path, {}).get("spans", [])}
        spans.update({(x.offset, x.nbytes): x.crc for x in extents if x.path == path})
        damaged[path] = {"identity": identity.record(), "spans": [[o, n, c] for (o, n), c in sorted(spans.items())]}
        _save(folder, _layouts(folder), damaged)


def damaged(folder: str) -> dict[str, dict[tuple[int, int], int]]:
    """Each file ``note_damaged`` remembers that is still as it was then (one whose identity changed, a new download,
    is read afresh): its spans (offset, bytes) -> the checksum its rows were laid out with."""
    if not os.path.isdir(folder):
        return {}
    with rows_folder.locked(folder):
        return {path: {(o, n): c for o, n, c in record["spans"]} for path, record in _damaged(folder).items()}


def tidy(folder: str) -> None:
    """Delete the files of rows in ``folder`` that no layout names and no process holds (a layout dropped while a
    process still read its files: they go once the last lets go)."""
    if os.path.isdir(folder):
        with rows_folder.locked(folder):
            rows_folder.sweep(folder, _named(_layouts(folder)))


def _save(folder: str, layouts: list[dict], damaged: dict | None = None) -> None:
    """Write ``layouts`` and the damaged files' records (``damaged``; else those kept there, still current)."""
    rows_folder.sweep(folder, _named(layouts))
    damaged = _damaged(folder) if damaged is None else damaged
    tmp = os.path.join(folder, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"version": VERSION, "layouts": layouts, **({"damaged": damaged} if damaged else {})}, f)
    os.replace(tmp, os.path.join(folder, MANIFEST))


def _named(layouts: list[dict]) -> set[str]:
    return {f[0] for x in layouts for f in x["files"]}


def _read(folder: str) -> dict:
    """The manifest as saved; empty where it is missing or not a JSON object."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _layouts(folder: str) -> list[dict]:
    """The manifest's layouts of a readable shape; none where it is missing, damaged or of another version."""
    data = _read(folder)
    if not data:
        return []
    layouts = data.get("layouts") if data.get("version") == VERSION else [data]  # version 1: one layout alone
    return [x for x in layouts if _readable(x)] if isinstance(layouts, list) else []


def _damaged(folder: str) -> dict[str, dict]:
    """The manifest's records of damaged files (``note_damaged``) whose files are as they were then."""
    records = _read(folder).get("damaged")
    out = {}
    for path, record in records.items() if isinstance(records, dict) else ():
        try:
            if Identity.of(path) == Identity(*record["identity"]) and all(len(x) == 3 for x in record["spans"]):
                out[path] = record
        except (OSError, KeyError, TypeError, ValueError):
            pass  # gone, replaced or unreadable: nothing to hold against it
    return out


def _readable(layout: object) -> bool:
    return (isinstance(layout, dict) and isinstance(layout.get("files"), list)
            and all(isinstance(f, list) and f and isinstance(f[0], str) for f in layout["files"]))


def _parsed(layout: dict) -> bool:
    """Whether this version reads ``layout`` (one it cannot would stand for its source forever, never reused)."""
    return DiskRows.from_manifest(layout, layout.get("source")) is not None


def _current(layout: dict) -> bool:
    """Every file of ``layout``, and every file its source names, is as it was when the layout was saved."""
    try:
        source_files = layout["source"].get("files", {})
        files = [*layout["files"], *([p, *record] for p, record in source_files.items())]
        return all(Identity.of(p) == Identity(*record) for p, *record in files)
    except (OSError, AttributeError, KeyError, TypeError, ValueError):
        return False
