"""Prompt files, as ``moepage record`` reads them: text prompts (one a line, or a ``.jsonl`` file of objects with a
``"text"`` field) or token ids (whitespace-separated integers, one prompt a line). Blank lines are skipped; every
problem is a ``ConfigError`` naming the file and line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import ConfigError


def _lines(path: str | os.PathLike) -> list[tuple[int, str]]:
    """``(line number, text)`` of the non-blank lines of ``path``; none at all is an error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the prompts file: {exc}") from None
    found = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not found:
        raise ConfigError(f"{path}: no prompts in the file (it is empty or blank)")
    return found


def read_prompts(path: str | os.PathLike) -> list[str]:
    """Text prompts: one a line, or in a ``.jsonl`` file a JSON object ``{"text": ...}`` a line."""
    lines = _lines(path)
    if Path(path).suffix != ".jsonl":
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{n}: not JSON ({exc.msg}); a .jsonl prompts file has one "
                              '{"text": "..."} object a line') from None
        text = row.get("text") if isinstance(row, dict) else None
        if not isinstance(text, str) or not text:
            raise ConfigError(f'{path}:{n}: expected an object with a non-empty string "text", got {line[:60]!r}')
        prompts.append(text)
    return prompts


def read_token_ids(path: str | os.PathLike) -> list[list[int]]:
    """Token-id prompts: whitespace-separated non-negative integers, one prompt a line."""
    prompts = []
    for n, line in _lines(path):
        ids = []
        for word in line.split():
            if not (word.isascii() and word.isdigit()):
                raise ConfigError(f"{path}:{n}: {word!r} is not a token id; a token-ids file has whitespace-"
                                  "separated non-negative integers, one prompt a line")
            ids.append(int(word))
        prompts.append(ids)
    return prompts
