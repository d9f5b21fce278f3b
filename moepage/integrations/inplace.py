"""An engine layer's expert rows read where the checkpoint holds them, with a disk tier: no second copy of the experts.

The engine's loader writes each checkpoint tensor into a scratch row (``RowsInPlace.load``, the row first filled with
a byte no candidate part starts with). Where the row then holds the tensor's bytes unchanged, or a TP rank's rows of
it (a run of the tensor), as a part of the row (gate, up of a fused row), and those bytes lie in one of the
checkpoint's safetensors files (``CheckpointIndex``), only where they lie is kept; a row whose parts cover it whole is
read from there. Everything else goes to moepage's staged file as before: a tensor the loader changed (a cast, a TP
rank's columns of down), one written into every row at once, a row no loader wrote whole (the base method's initial
value fills the rest).

A tensor is found in the checkpoint by its size and its first and last bytes (several candidates: by all of them).
The extent's checksum is the loaded bytes', so a wrong match, or a file changed later, fails its first read with
``PageInError`` naming the file: never a silent wrong row."""

from __future__ import annotations

import functools
import os
import threading
import zlib
from collections.abc import Callable, Sequence

import torch

from ..backends.disk import Extent, Identity
from ..errors import ConfigError
from ..planning.sizing import read_header

KEY_BYTES = 64  # of each end of a tensor: with its size, what finds it among a checkpoint's tensors


class CheckpointIndex:
    """Every tensor of a checkpoint's safetensors ``files``, found by its bytes (built at the first ``locate``; one
    per checkpoint in a process, ``of``)."""

    @staticmethod
    def of(files: Sequence[str]) -> CheckpointIndex:
        """The process's index of ``files`` as they are now: every layer of a model shares it (built once, not once
        per layer); a file changed since makes a new one."""
        return _index(tuple((os.path.realpath(f), *Identity.of(f).record()) for f in files))

    def __init__(self, files: Sequence[str]):
        self.files = [os.path.realpath(f) for f in files]
        self._index: dict[tuple[int, bytes, bytes], list[tuple[str, int]]] | None = None
        self._lock = threading.Lock()

    def _build(self) -> dict[tuple[int, bytes, bytes], list[tuple[str, int]]]:
        index: dict[tuple[int, bytes, bytes], list[tuple[str, int]]] = {}
        for path in self.files:
            fd = os.open(path, os.O_RDONLY)
            try:
                for t in read_header(path):
                    k = min(KEY_BYTES, t.nbytes)
                    if k:
                        ends = (os.pread(fd, k, t.offset), os.pread(fd, k, t.offset + t.nbytes - k))
                        index.setdefault((t.nbytes, *ends), []).append((path, t.offset))
            finally:
                os.close(fd)
        return index

    def locate(self, data: memoryview) -> tuple[str, int] | None:
        """(file, offset) where the checkpoint holds ``data``'s bytes, or None."""
        n = len(data)
        k = min(KEY_BYTES, n)
        with self._lock:
            if self._index is None:
                self._index = self._build()
            found = self._index.get((n, bytes(data[:k]), bytes(data[n - k :])), [])
        if len(found) == 1:
            return found[0]
        for path, offset in found:  # the same ends: the one holding these bytes (any, where several do)
            if _pread(path, n, offset) == data:
                return path, offset
        return None


class RowsInPlace:
    """One engine layer's rows (``staged``: name -> the ``[E, ...]`` file-backed rows ``disk.staged_rows`` made),
    each laid out in the checkpoint (parts recorded as extents) or in its staged file. ``initial(name, expert)``: the
    value a row holds where no loader wrote (the base method's, as on the device)."""

    def __init__(self, index: CheckpointIndex, staged: dict[str, torch.Tensor],
                 initial: Callable[[str, int], torch.Tensor]):
        self.index, self.staged, self.initial = index, staged, initial
        self.parts: dict[tuple[str, int], dict[int, Extent]] = {}  # (tensor, expert) -> byte offset in row -> extent
        self.in_file: set[tuple[str, int]] = set()
        self._scratch = {n: torch.empty(r.shape[1:], dtype=r.dtype, device="cpu") for n, r in staged.items()}
        self._lock = threading.Lock()

    def load(self, name: str, expert: int | None, loaded: torch.Tensor, write: Callable[[torch.Tensor], object]):
        """The engine's loader, ``write(rows)``, of checkpoint tensor ``loaded`` into row ``expert`` of ``name``
        (None: into every row) of ``[E, ...]`` ``rows``; its result."""
        with self._lock:
            if expert is not None and (name, expert) not in self.in_file and self._may_be_in_place(name, loaded):
                data = loaded.detach().reshape(-1).view(torch.uint8)
                scratch = self._scratch[name]
                row = scratch.view(-1).view(torch.uint8)
                row.fill_(_fill_for(data, row.numel()))  # no stale byte can pass for what this write put there
                out = write(scratch.expand(self.staged[name].shape))  # every row the one scratch row
                if self._record(name, expert, data, row):
                    return out
            for e in range(self.staged[name].shape[0]) if expert is None else (expert,):
                self._to_file(name, e)
            return write(self.staged[name])

    def _may_be_in_place(self, name: str, loaded: torch.Tensor) -> bool:
        return (loaded.device.type == "cpu" and loaded.dtype == self._scratch[name].dtype and loaded.is_contiguous()
                and loaded.numel() > 0)

    def _record(self, name: str, expert: int, data: torch.Tensor, row: torch.Tensor) -> bool:
        """Where in the row the loader put ``data`` (the loaded tensor's bytes), or a rank's shard of it along its
        first dimension, unchanged, and where the checkpoint holds that: recorded."""
        parts = self.parts.setdefault((name, expert), {})
        found = _placed(data, row, parts)
        if found is not None:
            offset, start, size = found
            view = memoryview(data.numpy())
            at = self.index.locate(view)
            if at is not None:
                parts[offset] = Extent(at[0], at[1] + start, size, zlib.crc32(view[start : start + size]))
                return True
        if not parts:
            del self.parts[(name, expert)]
        return False

    def _to_file(self, name: str, expert: int) -> None:
        """Row ``expert`` of ``name`` into the staged file: its initial value, then the parts found in place so far."""
        if (name, expert) in self.in_file:
            return
        row = self.staged[name][expert]
        row.copy_(self.initial(name, expert))
        flat = row.view(-1).view(torch.uint8)
        for offset, x in self.parts.pop((name, expert), {}).items():
            data = _pread(x.path, x.nbytes, x.offset)
            if zlib.crc32(data) != x.crc:
                raise ConfigError(f"{x.path}: changed while the checkpoint was loading (bytes {x.offset}.."
                                  f"{x.offset + x.nbytes}); load it again")
            flat[offset : offset + x.nbytes].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.in_file.add((name, expert))

    def _whole(self, name: str, expert: int) -> list[Extent] | None:
        """The extents of row ``expert`` of ``name`` in row order where they cover it whole, equal parts; else None."""
        parts = self.parts.get((name, expert))
        if not parts:
            return None
        size = next(iter(parts.values())).nbytes
        row = self._scratch[name].numel() * self._scratch[name].element_size()
        if sorted(parts) != list(range(0, row, size)) or any(x.nbytes != size for x in parts.values()):
            return None
        return [parts[o] for o in sorted(parts)]

    def settle(self) -> tuple[dict[str, dict[int, list[Extent]]], dict[str, list[int]]]:
        """After the last load: (name -> expert -> its extents in the checkpoint, name -> experts in the staged
        file); every row not in the checkpoint whole is moved to the file."""
        in_place: dict[str, dict[int, list[Extent]]] = {n: {} for n in self.staged}
        for n, rows in self.staged.items():
            for e in range(rows.shape[0]):
                if (n, e) not in self.in_file:
                    extents = self._whole(n, e)
                    if extents is None:
                        self._to_file(n, e)
                    else:
                        in_place[n][e] = extents
        in_file = {n: sorted(e for m, e in self.in_file if m == n) for n in self.staged}
        return in_place, in_file


MAX_SHARDS = 8  # a loader may put 1/t of a tensor in the row (a TP rank's rows of gate or up), t up to this


def _part_sizes(n: int, row_bytes: int) -> list[int]:
    """The sizes a part of the row may have, the whole of ``n`` loaded bytes first: 1/t of them, t up to MAX_SHARDS,
    where they divide both."""
    return [n // t for t in range(1, MAX_SHARDS + 1) if n % t == 0 and row_bytes % (n // t) == 0]


def _fill_for(data: torch.Tensor, row_bytes: int) -> int:
    """A byte no chunk of ``data`` that could fill a part of the row starts with: a region still all of it was not
    written (``_placed``)."""
    firsts = {int(data[q]) for size in _part_sizes(data.numel(), row_bytes) for q in range(0, data.numel(), size)}
    return next(b for b in range(256) if b not in firsts)


def _placed(data: torch.Tensor, row: torch.Tensor, taken: dict) -> tuple[int, int, int] | None:
    """(offset in the row, start in ``data``, size): a part of the row, not in ``taken``, that holds ``data``'s
    bytes or 1/t of them (a contiguous chunk: a shard along the first dimension), the whole tried first."""
    n, r = data.numel(), row.numel()
    head = 16
    for size in _part_sizes(n, r):
        for offset in range(0, r, size):
            if offset in taken:
                continue
            lead = bytes(row[offset : offset + min(head, size)].numpy())
            for start in range(0, n, size):  # a cheap look at the first bytes before the whole chunk
                if bytes(data[start : start + min(head, size)].numpy()) == lead and \
                        torch.equal(row[offset : offset + size], data[start : start + size]):
                    return offset, start, size
    return None


@functools.lru_cache(maxsize=2)
def _index(files: tuple[tuple, ...]) -> CheckpointIndex:
    return CheckpointIndex([f[0] for f in files])


def _pread(path: str, n: int, offset: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        out = b""
        while len(out) < n:
            chunk = os.pread(fd, n - len(out), offset + len(out))
            if not chunk:
                break
            out += chunk
        return out
    finally:
        os.close(fd)
