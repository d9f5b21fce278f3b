"""The manifest of a spill folder: the layouts of expert rows on disk that earlier loads kept there, one per source
(what the rows were made from, as a dict; its ``files``, ``{real path: identity record}``, the files they were read
from), so a restart reuses its rows instead of writing them again.

Loads of different sources share a folder without orphaning each other's files. A layout whose files changed (its
checkpoint rewritten, a file removed) is dropped when the next layout is saved, and its files of rows with it once no
process holds them (``folder``); files no layout names and no process holds (a killed process's, a manifest that could
not be read) are swept then too. Two loads of one source at once keep the first layout saved; the other load's files
go with its store. A checkpoint file whose rows, read in place, failed their checksums with its identity unchanged is
remembered (``note_damaged``: its rows' spans and checksums) until its identity changes, so a later load does not lay
its changed bytes out as if they were the checkpoint's (``damaged``). A layout not reused for damage to the folder (a
manifest that could not be read, a file of rows changed, shortened or gone while its checkpoint stayed as it was) is
laid out again, and a warning says so once, naming the file and what is wrong (``_not_reused``). Everything here runs
under the folder's lock.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from ..config import listed
from . import folder as rows_folder
from .disk import DiskRows, Extent, Identity, OsFile, RowFile
from .protocol import RowSpec

MANIFEST = rows_folder.MANIFEST
VERSION = 2  # {"version": 2, "layouts": [DiskRows.manifest(...), ...]}; version 1 was one layout alone
_SAID: set[str] = set()  # the warnings this process gave of layouts not reused: each once


def find(folder: str, source: dict, opener: Callable[[str], RowFile] = OsFile, hold: bool = True) -> DiskRows | None:
    """The rows an earlier load of ``source`` kept in ``folder``, its files as they were (``hold``: each held for the
    caller, who releases it when done); None if none."""
    if not os.path.isdir(folder):
        return None
    with rows_folder.locked(folder):
        layouts = _layouts(folder)
        rows_folder.sweep(folder, _named(layouts))
        for layout in layouts:
            if (found := DiskRows.from_manifest(layout, source, opener)) is None:
                if layout.get("source") == source and (why := _unusable(layout)) is not None:
                    _not_reused(folder, layout, why)
            else:
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
    unfit = [f"{layer}.{name}" for layer, tensors in specs.items() for name, spec in tensors.items()
             if not found.serves((layer, name), replace(spec, code=found.codes.get((layer, name))))]
    if unfit:
        _not_reused(folder, {"source": source}, f"the rows it lays out of {listed(unfit, 2)} are not whole or not of "
                    "the bytes this load keeps of a row (a manifest edited, or written by another version)")
        drop(folder, source)
        return None
    return found


def keep(folder: str, layout: dict, source: dict) -> bool:
    """Save ``layout`` (``DiskRows.manifest``, of sealed rows) as ``source``'s in ``folder``, dropping layouts whose
    files changed; False where a layout of ``source`` is there already (kept meanwhile by another load): the caller's
    own files then stay its own."""
    with rows_folder.locked(folder):
        layouts = []
        for x in _layouts(folder):
            if _current(x) and _parsed(x):
                layouts.append(x)
            elif (why := _unusable(x)) is not None:  # (its checkpoint changed: it goes unremarked)
                _not_reused(folder, x, why)
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


def _read(folder: str) -> tuple[dict, str | None]:
    """The manifest as saved (empty where it is missing or cannot be read) and why it cannot be read (None: it can, or
    there is none)."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}, None
    except OSError as exc:
        return {}, f"it cannot be opened: {exc.strerror or exc}"
    except ValueError as exc:
        return {}, f"it is not JSON: {exc}"
    return (data, None) if isinstance(data, dict) else ({}, f"it holds a JSON {type(data).__name__}, not an object")


def _layouts(folder: str) -> list[dict]:
    """The manifest's layouts of a readable shape; none where it is missing, damaged or of another version (a warning
    says which, once)."""
    data, why = _read(folder)
    version = data.get("version")
    layouts = data.get("layouts") if version == VERSION else [data] if version == 1 else None  # 1: one layout alone
    if data and why is None:
        if version not in (1, VERSION):
            why = f"its version is {version!r}, this moepage reads 1 and {VERSION}"
        elif not isinstance(layouts, list):
            why = "its layouts are no list"
        elif bad := sum(not _readable(x) for x in layouts):
            why = f"{bad} of its {len(layouts)} layouts are not of the shape this moepage writes"
    if why is not None:
        _say(f"moepage: spill folder {folder}: its manifest {os.path.join(folder, MANIFEST)} could not be read "
             f"({why}); the expert rows kept there are not reused, they are laid out again")
    return [x for x in layouts if _readable(x)] if isinstance(layouts, list) else []


def _damaged(folder: str) -> dict[str, dict]:
    """The manifest's records of damaged files (``note_damaged``) whose files are as they were then."""
    records = _read(folder)[0].get("damaged")
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
    return _as_recorded(layout, own=True)


def _as_recorded(layout: dict, own: bool) -> bool:
    """Whether every file the source of ``layout`` names (and, with ``own``, every file of its rows) is as recorded."""
    try:
        source_files = layout["source"].get("files", {})
        files = [*(layout["files"] if own else ()), *([p, *record] for p, record in source_files.items())]
        return all(Identity.of(p) == Identity(*record) for p, *record in files)
    except (OSError, AttributeError, KeyError, TypeError, ValueError):
        return False


def _unusable(layout: dict) -> str | None:
    """Why ``layout``, its checkpoint as it was, cannot be reused: a file of its rows changed, shortened or gone, or its
    record unreadable. None where it can be, and where its checkpoint changed (a new checkpoint: no damage to say)."""
    if not _as_recorded(layout, own=False):
        return None
    try:
        for path, *record in layout["files"]:
            then = Identity(*record)
            try:
                now = Identity.of(path)
            except FileNotFoundError:
                return f"{path} is missing"
            if now.size < then.size:
                return f"{path} is shorter than its manifest says ({now.size} bytes, {then.size} laid out)"
            if now != then:
                return f"{path} changed after its rows were laid out ({then.changes(now)})"
    except (OSError, TypeError, ValueError):
        pass
    return None if _parsed(layout) else "its record in the manifest could not be read"


def _not_reused(folder: str, layout: dict, why: str) -> None:
    """Warn (once) that the rows of ``layout`` kept in ``folder`` are not reused, and ``why``."""
    source = layout.get("source") or {}
    files = source.get("files") if isinstance(source.get("files"), dict) else {}
    of = f" of {listed(sorted({os.path.dirname(p) for p in files}), 2)}" if files else ""
    rows = "coded expert rows" if source.get("coded") else "expert rows"
    _say(f"moepage: spill folder {folder}: the {rows}{of} an earlier load kept there are not reused because {why}; "
         "they are laid out again")


def _say(text: str) -> None:
    if text not in _SAID:
        _SAID.add(text)
        warnings.warn(text, stacklevel=4)
