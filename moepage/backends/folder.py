"""A spill folder's files of rows (``*.moepage``): made under the folder's lock and held (a shared ``flock``) by every
process that uses them for as long as it does. A file is deleted only when no process holds it, so a sweep removes
what a killed process left (its locks die with it) without touching what a live one reads."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator

from ..errors import ConfigError

SUFFIX = ".moepage"
LOCK = ".lock"
MANIFEST = "manifest.json"  # the layouts kept in the folder (``manifest``; its copy being written: "*.tmp")
_HELD: dict[str, list[int]] = {}  # real path -> [fd this process holds it by, holders in this process]
_LOCKED: dict[str, int] = {}  # real path of a folder -> the thread of this process holding its lock
_AFTER: dict[str, list[Callable[[], None]]] = {}  # real path of a folder -> what waits for its lock's release


@contextlib.contextmanager
def locked(folder: str) -> Iterator[None]:
    """The folder's lock (made with the folder if missing), for whatever reads or changes what is in it."""
    path = os.path.join(folder, LOCK)
    while True:
        with _made(folder):
            os.makedirs(folder, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _is(fd, path):
            break
        os.close(fd)  # deleted while this waited for it (``unlock``): the lock is the file there now
    key = os.path.realpath(folder)
    _LOCKED[key] = threading.get_ident()
    try:
        yield
    finally:
        del _LOCKED[key]
        os.close(fd)
        for then in _AFTER.pop(key, ()):
            with contextlib.suppress(OSError, ConfigError):
                then()


def when_free(folder: str, then: Callable[[], None]) -> None:
    """``then()`` now, or, where this thread holds the folder's lock (a finalizer the garbage collector runs inside a
    locked section), once it lets it go: taking the lock again would wait on itself for ever."""
    key = os.path.realpath(folder)
    if _LOCKED.get(key) == threading.get_ident():
        _AFTER.setdefault(key, []).append(then)
    else:
        then()


def unlock(folder: str) -> None:
    """Delete the folder's lock file where it guards nothing now (no file of rows, no manifest) and no process holds
    it: a folder of rows all deleted is left as it was found. One waiting for it meanwhile takes a new one
    (``locked``)."""
    path = os.path.join(folder, LOCK)
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if _is(fd, path) and not any(n.endswith(SUFFIX) or n.startswith(MANIFEST) for n in os.listdir(folder)):
            os.remove(path)
    except OSError:  # held by another process (at work in the folder), or gone meanwhile: it stays as it is
        pass
    finally:
        os.close(fd)


def _is(fd: int, path: str) -> bool:
    """Whether ``fd`` is the file at ``path`` now (not one deleted since it was opened)."""
    try:
        now, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


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
