"""What a disk tier does with rows found damaged when read (``DamagedRowsError``): the layout they belong to is dropped
from the spill folder's manifest, once; rows read in place from a checkpoint's own file send the user to the
checkpoint, and the folder remembers the file (``manifest.note_damaged``), so a later load refuses its changed bytes
(``in_place``) instead of taking them for the checkpoint's."""

from __future__ import annotations

from ..errors import ConfigError, DamagedRowsError
from . import folder, manifest
from .disk import DiskRows, Extent, Identity

CHECKPOINT_CHANGED = ("These rows are read in place from the checkpoint's own file, whose bytes changed on disk while "
                      "its size, times and inode did not: verify the checkpoint (its checksums) or download it again. "
                      "Until that file is replaced, loads over this spill folder refuse the bytes that changed")


class Damage:
    """A store's record of damaged rows in ``spill_dir``: the checkpoint files it noted, and those the folder
    remembers."""

    def __init__(self, spill_dir: str):
        self.spill_dir = spill_dir
        self._damaged: dict[str, dict[tuple[int, int], int]] | None = None  # ``damaged``, read once
        self._noted: set[str] = set()  # checkpoint files found damaged, remembered in the folder

    def found(self, exc: DamagedRowsError, source: dict | None, disk: DiskRows) -> DamagedRowsError:
        """The error to raise for ``exc``, rows of ``disk`` of a layout kept or reused for ``source`` (None: of this
        load alone), that layout dropped: ``exc`` itself, or one saying what the user does."""
        if source is not None:
            manifest.drop(self.spill_dir, source)
        if exc.path is not None and not folder.ours(exc.path, self.spill_dir):
            if exc.path not in self._noted:
                self._noted.add(exc.path)
                manifest.note_damaged(self.spill_dir, exc.path, disk.identity.get(exc.path) or Identity.of(exc.path),
                                      disk.extents(exc.path))
            return DamagedRowsError(f"{exc}. {CHECKPOINT_CHANGED}", exc.path)
        if source is None:
            return exc
        return DamagedRowsError(f"{exc}. The layout they belong to is dropped from {self.spill_dir}: load again to lay "
                                "them out anew", exc.path)

    def damaged(self) -> dict[str, dict[tuple[int, int], int]]:
        """The checkpoint files the folder remembers as damaged (``manifest.damaged``), read once."""
        if self._damaged is None:
            self._damaged = manifest.damaged(self.spill_dir)
        return self._damaged

    def in_place(self, layer: str, name: str, expert: int, extent: Extent) -> Extent:
        """``extent``, of a checkpoint's own file read in place; refused where the folder remembers that file as
        damaged and these are not the bytes an earlier load laid its rows out from."""
        spans = self.damaged().get(extent.path)
        if spans is not None and spans.get((extent.offset, extent.nbytes)) != extent.crc:
            raise ConfigError(f"layer {layer}: expert {expert} of {name!r} from {extent.path} (bytes {extent.offset}.."
                              f"{extent.offset + extent.nbytes}): an earlier load found this file's rows damaged, and "
                              f"these bytes are not those it laid them out from. {CHECKPOINT_CHANGED}")
        return extent
