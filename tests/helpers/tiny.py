"""The committed tiny trained Qwen3-MoE (``tests/data/tiny_moe``, trained by
``bench/models/train_moe.py --preset tiny`` on Python's standard library, one byte per token)
and real text to run it on."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

CKPT = Path(__file__).resolve().parents[1] / "data" / "tiny_moe"
PAD = 257  # the byte tokenizer's unused padding id (bytes 0..255, end of file 256)


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def text_tokens(tokens: int) -> torch.Tensor:
    """``[1, tokens]`` byte tokens of real source code (the standard library's ``textwrap``)."""
    import textwrap

    data = inspect.getsource(textwrap).encode("utf-8")[:tokens]
    return torch.tensor([list(data)])
