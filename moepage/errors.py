"""Errors moepage raises. All derive from ``MoepageError`` so callers can catch one type."""

from __future__ import annotations


class MoepageError(Exception):
    """Base class of every moepage error."""


class ConfigError(MoepageError, ValueError):
    """Bad input to ``wrap`` (or a loader): raised before anything is allocated."""


class PageInError(MoepageError, RuntimeError):
    """A page-in failed. Residency stays consistent: the next step is exact."""


class DamagedRowsError(PageInError):
    """Rows on disk are not the bytes laid out (a checksum or size mismatch, the file unchanged otherwise): the layout
    they belong to is dropped, so the next load lays them out anew; rows read in place from a checkpoint's own file
    send the user to the checkpoint instead. ``path``: the file whose bytes failed their checksum, where known."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class VerifyError(MoepageError, AssertionError):
    """Verify mode found a slot whose contents differ from its host row."""
