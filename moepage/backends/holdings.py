"""The files of rows a ``TieredStore`` holds in its spill folder: its own spill files (one per tensor of each layer, so
one layer's layout can be kept, sealed, while later layers still write theirs), the files it owns (no manifest names
them: deleted when it lets go) and those it only reads (a kept layout's: released, and swept once no layout names
them); the folder's lock file goes too where nothing is left that it guards. Letting go runs at close, when the store
is dropped unclosed, or at exit (``let_go`` needs no store), so a model never unwrapped leaves no copy of its experts
behind (a killed process's: the next sweep)."""

from __future__ import annotations

import contextlib
import logging
import shutil

from ..errors import ConfigError
from . import folder, manifest
from .disk import SpillFile

logger = logging.getLogger("moepage")


class Holdings:
    """The spill files, held and owned files of one store over ``spill_dir``."""

    def __init__(self, spill_dir: str):
        self.spill_dir = spill_dir
        self.spills: dict[tuple[str, str], SpillFile] = {}  # (layer, tensor) -> the file of rows it must write
        self.held: list[str] = []  # files this store holds (``folder.hold``)
        self.owned: list[str] = []  # of those, the ones no manifest names

    def spill(self, layer: str, name: str, fresh: bool = False) -> SpillFile:
        """The tensor's spill file; a new one where asked (``fresh``) or where its last was sealed (``seal``: rows
        written since, a load of new weights, say, go to a file of their own, and the kept layout stays the
        checkpoint's)."""
        key = (layer, name)
        if fresh or key not in self.spills or self.spills[key].closed:
            first = not self.spills
            spill = self.spills[key] = SpillFile.new(self.spill_dir)  # the folder made if missing
            self.take(spill.path, owned=True)
            if first:
                logger.info("moepage: writing the expert rows it must keep on disk to %s (%.3g GB free there)",
                            self.spill_dir, shutil.disk_usage(self.spill_dir).free / 1e9)
        return self.spills[key]

    def take(self, path: str, owned: bool) -> None:
        """``path``, which this process holds already, is this store's to let go (``owned``: to delete)."""
        self.held.append(path)
        if owned:
            self.owned.append(path)

    def retire(self, spill: SpillFile, instead: SpillFile | None = None) -> None:
        """``spill`` no longer read: closed and let go (deleted where no manifest names it); its tensor's spill file
        is ``instead`` again where given."""
        for key, current in list(self.spills.items()):
            if current is spill:
                if instead is None:
                    del self.spills[key]
                else:
                    self.spills[key] = instead
        spill.close()
        self.held.remove(spill.path)
        if spill.path in self.owned:
            self.owned.remove(spill.path)
            folder.drop(spill.path)
        else:
            folder.release(spill.path)  # a kept layout names it: a later load reads it

    def seal(self, layer: str | None = None) -> None:
        """Close the spill files (``layer``'s alone, where given): written whole, their identity can be taken."""
        for (owner, _), spill in self.spills.items():
            if layer in (None, owner):
                spill.close()

    def named(self, paths) -> None:
        """A manifest names ``paths`` now: a later load reads them, so they stay when this store lets go."""
        for path in paths:
            if path in self.owned:
                self.owned.remove(path)


def let_go(holdings: Holdings) -> None:
    """Release every file ``holdings`` holds, deleting those no manifest names (unless another process holds them;
    one already gone is no error), and sweep the folder where a kept layout's files were released (a layout dropped
    while this store read them: they go with their last user)."""
    holdings.seal()
    kept = False
    for path in holdings.held:
        if path in holdings.owned:
            folder.drop(path)
        else:
            folder.release(path)
            kept = True
    holdings.held.clear()
    holdings.owned.clear()
    if kept:
        with contextlib.suppress(OSError, ConfigError):  # a folder gone or made unwritable meanwhile
            manifest.tidy(holdings.spill_dir)
    folder.unlock(holdings.spill_dir)  # its files all gone: nor its lock stays
