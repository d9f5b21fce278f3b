"""Fixtures of every test (helpers live in the ``helpers`` package: routing, reference models,
tiny models, decode loops, SGLang set-up)."""

from __future__ import annotations

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--measurements", action="store_true",
                     help="also run tests marked measurement (they decide a product choice, e.g. whether a refused "
                          "format could join the served ones, and are expected to fail while it stays refused)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--measurements"):
        return
    skip = pytest.mark.skip(reason="a measurement, not a test of what moepage serves: run with --measurements")
    for item in items:
        if "measurement" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same random state (torch, random): a draw a test did not seed itself gives the
    same values on every run, so a test passes or fails the same way each time."""
    import random

    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def inference():
    """Every test runs with grad mode off, as inference does: moepage computes no gradients and
    refuses to run where one is expected (``moepage.nn.hooks``). Tests of that rule turn grad
    mode on themselves."""
    with torch.no_grad():
        yield


@pytest.fixture
def single_thread():
    """One intra-op thread for the test: these tensors are tiny, and on a busy 2-core machine
    OpenMP hand-offs of tiny ops (index_add_) cost milliseconds each."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a whole module of tiny models (they gain nothing from threads, and
    OpenMP barriers cost whole scheduler slices on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- Triton kernels: interpreted (CPU) or compiled (GPU) ---------------------------------------------
@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    if _planner().triton_available():
        from triton.runtime.interpreter import InterpretedFunction

        if isinstance(_planner().tl.standard.sort, InterpretedFunction):
            pytest.skip("triton was imported under TRITON_INTERPRET=1: its library cannot compile")
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _planner():
    from moepage.kernels import runtime as planner

    return planner
