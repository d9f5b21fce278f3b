"""Expert rows on disk, the tier under the host memory of a ``TieredStore``: where every row of every paged tensor lives
(extents of a checkpoint's own files, read in place, or of moepage's spill file), read with aligned direct reads, each
extent checked against its checksum and its file against the identity it had when the rows were laid out.

- ``Extent``: bytes ``[offset, offset + nbytes)`` of one file, and their CRC-32. A row is one or more extents (a
  checkpoint's gate and up projections, each in place, make one fused row).
- ``DiskRows``: the extents of every (layer, tensor, expert), the files' identities (size, mtime, inode), the code of
  each tensor kept coded (``moepage.compress``), and the ``read`` that checks both; ``manifest`` / ``from_manifest``
  save and reuse a layout across restarts.
- ``SpillFile``: moepage's own file of rows it had to transform (or was given in memory), each at a 4 KiB boundary.
- ``staged_rows``: a file-backed tensor an engine's loader writes rows into, laid out in place afterwards.
- Reads go through a ``RowFile`` (``OsFile``: ``O_DIRECT`` where the file system takes it, else buffered), into page-
  aligned bounce buffers (direct reads need the buffer, the offset and the length aligned; safetensors data is only
  8-byte aligned), from several threads (``os.preadv`` releases the GIL). Tests wrap ``RowFile`` to inject faults.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..compress import TensorCode
from ..errors import DamagedRowsError, PageInError
from .folder import new_file, ours
from .protocol import RowSpec

ALIGN = 4096  # what O_DIRECT needs of the buffer, the file offset and the length (4 KiB is safe everywhere)
MANIFEST_VERSION = 1


def _down(x: int) -> int:
    return x - x % ALIGN


def aligned(x: int) -> int:
    """``x`` rounded up to a 4 KiB boundary (``ALIGN``): where a spill file puts each row."""
    return _down(x + ALIGN - 1)


@dataclass(frozen=True)
class Identity:
    """What a file was when its rows were laid out: a change (rewritten, replaced, truncated) makes them stale. The
    change time too: a write that puts the modification time back (``os.utime``) still moves it."""

    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int

    @classmethod
    def of(cls, path: str) -> Identity:
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)

    def record(self) -> list[int]:
        return [self.size, self.mtime_ns, self.ctime_ns, self.inode]

    def changes(self, now: Identity) -> str:
        """What differs in ``now``, field by field: "its size: 10 then, 12 now; its inode: ..."."""
        return "; ".join(f"its {what}: {getattr(self, f)} then, {getattr(now, f)} now" for f, what in _FIELDS.items()
                         if getattr(self, f) != getattr(now, f))


_FIELDS = {"size": "size", "mtime_ns": "modification time (mtime_ns)", "ctime_ns": "change time (ctime_ns)",
           "inode": "inode"}


def identities(paths) -> dict[str, list[int]]:
    """Each file's real path (one name however it was reached) and identity: how a manifest's source names files."""
    return {os.path.realpath(p): Identity.of(p).record() for p in sorted(paths)}


@dataclass(frozen=True)
class Extent:
    """``nbytes`` bytes of ``path`` from ``offset``, whose CRC-32 is ``crc``."""

    path: str
    offset: int
    nbytes: int
    crc: int


class RowFile(Protocol):
    """An open file rows are read from."""

    def readinto(self, buf: memoryview, offset: int) -> int:
        """Read up to ``len(buf)`` bytes at ``offset`` into ``buf``; the count read (short at the end of the file)."""

    def close(self) -> None: ...


class OsFile:
    """A file opened for direct reads (``O_DIRECT``: no page cache competing with pinned memory) where the file system
    takes them, else for ordinary ones."""

    def __init__(self, path: str):
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except OSError:  # tmpfs and some others refuse O_DIRECT
            self.direct = False
            self.fd = os.open(path, os.O_RDONLY)

    def readinto(self, buf: memoryview, offset: int) -> int:
        return os.preadv(self.fd, [buf], offset)

    def close(self) -> None:
        os.close(self.fd)


class _Bounce(threading.local):
    """Each thread's page-aligned read buffer (anonymous mmap: page-aligned), grown as rows need."""

    def get(self, size: int) -> mmap.mmap:
        buf = getattr(self, "buf", None)
        if buf is None or len(buf) < size:
            self.buf = buf = mmap.mmap(-1, aligned(max(size, ALIGN)))
        return buf


class DiskRows:
    """The on-disk extents of every row of every paged tensor, and the checked reads of them."""

    def __init__(self, opener: Callable[[str], RowFile] = OsFile):
        self.opener = opener
        self.rows: dict[tuple[str, str], list[list[Extent | None]]] = {}  # (layer, tensor) -> expert -> parts
        self.codes: dict[tuple[str, str], TensorCode] = {}  # (layer, tensor) -> the code its rows are kept in
        self.identity: dict[str, Identity] = {}
        self._files: dict[str, RowFile] = {}
        self._lock = threading.Lock()
        self._bounce = _Bounce()

    # -- layout ------------------------------------------------------------------------------------------------
    def declare(self, layer: str, name: str, num_experts: int) -> None:
        self.rows.setdefault((layer, name), [[] for _ in range(num_experts)])

    def put(self, layer: str, name: str, expert: int, part: int, parts: int, extent: Extent) -> None:
        """Row ``expert`` of ``name``: its ``part``-th of ``parts`` pieces (in row order) lies at ``extent``."""
        row = self.rows[(layer, name)][expert]
        if len(row) != parts:
            row[:] = [None] * parts
        row[part] = extent

    def seal(self) -> None:
        """Take the identity of every file rows lie in (after the last row is written): reads check it from now."""
        for row in (r for experts in self.rows.values() for r in experts):
            for x in row:
                if x is not None and x.path not in self.identity:
                    self.identity[x.path] = Identity.of(x.path)

    def missing(self, layer: str, name: str) -> list[int]:
        """Experts of ``name`` whose row is not laid out whole."""
        return [e for e, row in enumerate(self.rows[(layer, name)]) if not row or any(x is None for x in row)]

    def serves(self, key: tuple[str, str], spec: RowSpec) -> bool:
        """Whether these rows of ``key`` (layer, tensor) are ``spec``'s: coded by its code (none: raw), of its shape,
        and every row laid out whole, of the bytes a store keeps of one (``RowSpec.held``)."""
        rows, code = self.rows.get(key), self.codes.get(key)
        return (bool(rows) and code == spec.code and (code is None or code.shape == spec.shape)
                and all(row and None not in row and sum(x.nbytes for x in row) == spec.held.nbytes for row in rows))

    def tally(self, spill_dir: str) -> tuple[int, int]:
        """Rows laid out: (those read in place, from files no one writes; those in moepage's own files in
        ``spill_dir``)."""
        rows = [row for experts in self.rows.values() for row in experts if row]
        own = {x.path for row in rows for x in row if x is not None and ours(x.path, spill_dir)}
        written = sum(any(x is not None and x.path in own for x in row) for row in rows)
        return len(rows) - written, written

    def extents(self, path: str) -> list[Extent]:
        """Every extent laid out in ``path``."""
        return [x for experts in self.rows.values() for row in experts for x in row if x is not None and x.path == path]

    def row_bytes(self, layer: str, name: str, expert: int) -> int:
        return sum(x.nbytes for x in self.rows[(layer, name)][expert])  # type: ignore[union-attr]

    def release(self, layer: str) -> None:
        for key in [k for k in self.rows if k[0] == layer]:
            del self.rows[key]
            self.codes.pop(key, None)

    # -- reads -------------------------------------------------------------------------------------------------
    def read(self, layer: str, name: str, expert: int, out: torch.Tensor) -> int:
        """Row ``expert`` of ``name`` into ``out`` (a contiguous CPU tensor of its bytes); its byte count. A stale
        file, a failed or short read, or a checksum that does not match raise ``PageInError`` naming the layer, the
        tensor, the expert and the file."""
        flat = out.view(-1).view(torch.uint8)
        pos = 0
        row = self.rows[(layer, name)][expert]
        if not row or None in row:  # read, it would leave ``out`` as it was: never silently
            raise PageInError(f"layer {layer}: expert {expert} of {name!r} was never laid out on disk (no loader "
                              "wrote its row; over a disk tier rows are written with place_row or write_rows)")
        if (laid := sum(x.nbytes for x in row)) != flat.numel():
            raise DamagedRowsError(f"layer {layer}: expert {expert} of {name!r} is laid out as {laid} bytes in "
                                   f"{row[0].path}, its row holds {flat.numel()}")
        for extent in row:
            where = f"layer {layer}: expert {expert} of {name!r} from {extent.path}"
            data = self._read_extent(extent, where)
            if zlib.crc32(data) != extent.crc:
                raise DamagedRowsError(f"{where} (bytes {extent.offset}..{extent.offset + extent.nbytes}): checksum "
                                       "mismatch, the file holds other bytes than when the rows were laid out",
                                       extent.path)
            flat[pos : pos + extent.nbytes].copy_(torch.frombuffer(data, dtype=torch.uint8))
            pos += extent.nbytes
        return pos

    def _read_extent(self, extent: Extent, where: str) -> memoryview:
        then = self.identity.get(extent.path)  # None: a file still being written (not sealed yet)
        if then is not None and (now := self._identity(extent.path, where)) != then:
            raise PageInError(f"{where}: the file changed after its rows were laid out ({then.changes(now)}); load "
                              "the model again")
        start, end = _down(extent.offset), aligned(extent.offset + extent.nbytes)
        buf = self._bounce.get(end - start)
        view = memoryview(buf)[: end - start]
        try:
            got = self._file(extent.path).readinto(view, start)
        except OSError as exc:
            raise PageInError(f"{where}: read failed: {exc}") from exc
        need = extent.offset + extent.nbytes - start
        if got < need:
            raise PageInError(f"{where}: short read, {got} of {need} bytes at {start}")
        return view[extent.offset - start : need]

    def _identity(self, path: str, where: str) -> Identity:
        try:
            return Identity.of(path)
        except OSError as exc:
            raise PageInError(f"{where}: {exc}") from exc

    def _file(self, path: str) -> RowFile:
        with self._lock:
            f = self._files.get(path)
            if f is None:
                f = self._files[path] = self.opener(path)
            return f

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()

    # -- the manifest: a layout reused across restarts -----------------------------------------------------------
    def manifest(self, source: dict, layer: str | None = None) -> dict:
        """The layout (of ``layer``'s rows alone, where given) as JSON, with ``source`` (what it was made from: the
        checkpoint's identity and the rows' format), so that a later load of the same source reuses it."""
        chosen = {key: experts for key, experts in self.rows.items() if layer is None or key[0] == layer}
        files = sorted({x.path for experts in chosen.values() for row in experts for x in row if x is not None})
        index = {p: i for i, p in enumerate(files)}
        rows = {f"{lay}\t{name}": [[[index[x.path], x.offset, x.nbytes, x.crc] for x in row] for row in experts]
                for (lay, name), experts in chosen.items()}
        codes = {"\t".join(key): code.record() for key, code in self.codes.items() if key in chosen}
        return {"version": MANIFEST_VERSION, "source": source,
                "files": [[p, *self.identity[p].record()] for p in files], "rows": rows, "codes": codes}

    @classmethod
    def from_manifest(cls, data: dict, source: dict, opener: Callable[[str], RowFile] = OsFile) -> DiskRows | None:
        """The layout ``manifest`` saved, if it was made from ``source`` and every file is as it was; else None (also
        for a layout of another shape: a damaged or foreign manifest is no layout)."""
        try:
            if data.get("version") != MANIFEST_VERSION or data.get("source") != source:
                return None
            out = cls(opener)
            paths = []
            for path, *record in data["files"]:
                if Identity.of(path) != Identity(*record):
                    return None
                out.identity[path] = Identity(*record)
                paths.append(path)
            for key, experts in data["rows"].items():
                layer, name = key.split("\t")
                out.rows[(layer, name)] = [[Extent(paths[i], off, n, crc) for i, off, n, crc in row]
                                           for row in experts]
            for key, code in data.get("codes", {}).items():
                layer, name = key.split("\t")
                out.codes[(layer, name)] = TensorCode.from_record(code)
            return out
        except (OSError, AttributeError, KeyError, IndexError, TypeError, ValueError):
            return None


def staged_rows(folder: str, label: str, num_experts: int, shape: tuple[int, ...], dtype: torch.dtype
                ) -> tuple[torch.Tensor, str]:
    """``[num_experts, *shape]`` rows backed by a new file in ``folder`` (a shared mapping: an engine's loader writes
    them through the page cache, so a checkpoint larger than host memory stages without needing the memory); row e at
    byte e * row bytes. ``TieredStore.place_file`` then lays the rows out in place. Returns the rows and the file."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in label)[-80:]
    path = new_file(folder, "staged-", f"-{safe}")
    count = num_experts * math.prod(shape)
    with open(path, "wb") as f:
        f.truncate(count * dtype.itemsize)
    return torch.from_file(path, shared=True, size=count, dtype=dtype).view(num_experts, *shape), path


def file_extents(path: str, experts: Sequence[int], row_bytes: int) -> list[Extent]:
    """The extents of rows ``experts`` of ``row_bytes``, row e at e times ``row_bytes`` of ``path`` (``staged_rows``):
    flushed to disk first (what a shared mapping wrote may still be in the page cache; direct reads bypass it), each
    checksummed as read back."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        out = []
        for e in experts:
            f.seek(e * row_bytes)
            data = f.read(row_bytes)
            if len(data) != row_bytes:
                raise PageInError(f"{path}: row {e} is short ({len(data)} of {row_bytes} bytes)")
            out.append(Extent(path, e * row_bytes, row_bytes, zlib.crc32(data)))
    return out


class SpillFile:
    """moepage's own file of rows, each at a 4 KiB boundary, appended and checksummed as written (unbuffered: a row
    reads back as soon as it is written)."""

    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.size = 0

    @classmethod
    def new(cls, folder: str) -> SpillFile:
        """A new spill file of a name of its own in ``folder`` (made if missing), held (``folder.hold``)."""
        return cls(new_file(folder, "rows-"))

    def write(self, tensor: torch.Tensor) -> Extent:
        """Append ``tensor``'s bytes (made contiguous, on the CPU); where they lie."""
        if self.fd is None:
            raise ValueError(f"{self.path}: closed")
        data = memoryview(tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy())
        offset = aligned(self.size)
        written = 0
        try:
            while written < len(data):
                written += os.pwrite(self.fd, data[written:], offset + written)
        except OSError as exc:  # a full disk, say: name the file
            raise OSError(exc.errno, f"writing expert rows to {self.path}: {exc.strerror}") from exc
        self.size = offset + len(data)
        return Extent(self.path, offset, len(data), zlib.crc32(data))

    @property
    def closed(self) -> bool:
        return self.fd is None

    def close(self) -> None:
        """Sync what was written and close (``DiskRows.seal`` takes its identity after this)."""
        if self.fd is not None:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = None
