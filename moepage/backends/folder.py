"""A spill folder's files of rows (``*.moepage``): made under the folder's lock and held (a shared ``flock``) by every
process that uses them for as long as it does. A file is deleted only when no process holds it, so a sweep removes
what a killed process left (its locks die with it) without touching what a live one reads."""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Iterable, Iterator

from ..errors import ConfigError

SUFFIX = ".moepage"
_HELD: dict[str, list[int]] = {}  # real path -> [fd this process holds it by, holders in this process]


@contextlib.contextmanager
def locked(folder: str) -> Iterator[None]:
    """The folder's lock (made with the folder if missing), for whatever reads or changes what is in it."""
    with _made(folder):
        os.makedirs(folder, exist_ok=True)
        fd = os.open(os.path.join(folder, ".lock"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def new_file(folder: str, prefix: str, label: str = "") -> str:
    """A new empty file of rows in ``folder``, held; its real path."""
    with locked(folder):
        path = os.path.join(os.path.realpath(folder), f"{prefix}{uuid.uuid4().hex[:12]}{label}{SUFFIX}")
        with _made(folder):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        hold(path)
    return path


@contextlib.contextmanager
def _made(folder: str) -> Iterator[None]:
    """A failure to make the folder or a file in it (a folder checked at load that changed since, say) as a
    ``ConfigError`` naming the folder, not a bare ``OSError``."""
    try:
        yield
    except OSError as exc:
        raise ConfigError(f"spill folder {os.path.abspath(folder)}: cannot make it or a file in it: "
                          f"{exc.strerror or exc}") from exc


def ours(path: str, folder: str) -> bool:
    """Whether ``path`` is a file of rows moepage wrote in ``folder`` (never a checkpoint's file, read in place)."""
    real = os.path.realpath(path)
    return os.path.dirname(real) == os.path.realpath(folder) and real.endswith(SUFFIX)


def hold(path: str) -> None:
    """This process uses ``path``: no other deletes it until ``release``."""
    real = os.path.realpath(path)
    if real in _HELD:
        _HELD[real][1] += 1
        return
    fd = os.open(real, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    _HELD[real] = [fd, 1]


def release(path: str) -> None:
    real = os.path.realpath(path)
    if (held := _HELD.get(real)) is not None:
        held[1] -= 1
        if held[1] == 0:
            del _HELD[real]
            os.close(held[0])


def drop(path: str) -> None:
    """Release ``path`` and delete it unless another process still holds it (a sweep deletes it then, once free)."""
    release(path)
    delete_if_free(path)


def delete_if_free(path: str) -> bool:
    """Delete ``path`` if no process holds it (this one included); whether it is gone."""
    real = os.path.realpath(path)
    if real in _HELD:
        return False
    try:
        fd = os.open(real, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # a deletion between this and the unlink is another sweep's: both end with the file gone
    with contextlib.suppress(FileNotFoundError):
        os.remove(real)
    return True


def sweep(folder: str, named: Iterable[str]) -> None:
    """Delete the files of rows in ``folder`` that ``named`` (the manifest's) leaves out and no process holds (call
    under ``locked``)."""
    keep = {os.path.realpath(p) for p in named}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(folder):
            if entry.name.endswith(SUFFIX) and os.path.realpath(entry.path) not in keep:
                delete_if_free(entry.path)
