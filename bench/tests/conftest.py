"""Fixtures of the benchmarks' CPU tests."""

from __future__ import annotations

import random

import pytest
import torch


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same random state (torch, random): a draw a test did not seed itself gives the
    same values on every run, so a test passes or fails the same way each time."""
    random.seed(0)
    torch.manual_seed(0)
