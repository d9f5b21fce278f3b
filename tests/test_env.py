"""``MOEPAGE_*`` environment variables: read through ``moepage._env``, with flags in any usual
spelling and a ``ConfigError`` naming the variable and the value for anything else."""

from __future__ import annotations

import logging

import pytest
import torch

import moepage
from moepage._env import env_flag, env_float, env_int, env_str
from moepage.backends.mock import MockStore
from moepage.toy import ToyExperts


@pytest.mark.parametrize("text,value", [
    ("1", True), ("true", True), ("TRUE", True), ("Yes", True), ("on", True), (" 1 ", True),
    ("0", False), ("false", False), ("No", False), ("OFF", False),
])
def test_flag_spellings(monkeypatch, text, value):
    monkeypatch.setenv("MOEPAGE_TEST_FLAG", text)
    assert env_flag("MOEPAGE_TEST_FLAG") is value


def test_unset_or_empty_gives_the_default(monkeypatch):
    monkeypatch.delenv("MOEPAGE_TEST_VAR", raising=False)
    assert env_flag("MOEPAGE_TEST_VAR") is False and env_flag("MOEPAGE_TEST_VAR", None) is None
    assert env_int("MOEPAGE_TEST_VAR", 7) == 7 and env_str("MOEPAGE_TEST_VAR", "x") == "x"
    monkeypatch.setenv("MOEPAGE_TEST_VAR", "  ")
    assert env_flag("MOEPAGE_TEST_VAR", True) is True and env_float("MOEPAGE_TEST_VAR", 0.25, 0.0, 1.0) == 0.25


@pytest.mark.parametrize("read,text,fragment", [
    (lambda n: env_flag(n), "maybe", "1/0, true/false"),
    (lambda n: env_int(n, 0, minimum=0), "abc", "whole number >= 0"),
    (lambda n: env_int(n, 0, minimum=0), "-2", "whole number >= 0"),
    (lambda n: env_float(n, 0.25, 0.0, 1.0), "25%", "number in [0, 1)"),
    (lambda n: env_float(n, 0.25, 0.0, 1.0), "1.5", "number in [0, 1)"),
    (lambda n: env_float(n, 0.25, 0.0, 1.0), "nan", "number in [0, 1)"),
    (lambda n: env_str(n, choices=["torch", "mock"]), "gpu", "one of torch, mock"),
])
def test_bad_values_name_the_variable_and_the_value(monkeypatch, read, text, fragment):
    monkeypatch.setenv("MOEPAGE_TEST_VAR", text)
    with pytest.raises(moepage.ConfigError) as info:
        read("MOEPAGE_TEST_VAR")
    assert f"MOEPAGE_TEST_VAR={text!r}" in str(info.value) and fragment in str(info.value)


def test_verify_accepts_true(monkeypatch):
    monkeypatch.setenv("MOEPAGE_VERIFY", "true")  # was: ValueError from int()
    module = ToyExperts(8, 16, 8, 2)
    moepage.wrap(module, resident=4, backend="mock")
    assert next(moepage.paged_layers(module)).pager.options.verify is True


@pytest.mark.parametrize("name,value", [("MOEPAGE_VERIFY", "maybe"), ("MOEPAGE_LOG_EVERY", "often")])
def test_bad_value_fails_the_wrap_and_leaves_nothing(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    module = ToyExperts(8, 16, 8, 2)
    before = module.gate_up_proj
    store = MockStore()
    with pytest.raises(moepage.ConfigError, match=f"{name}='{value}'"):
        moepage.wrap(module, resident=4, backend=store)
    assert module.gate_up_proj is before and store.host_bytes() == 0


def test_log_line_has_no_doubled_prefix(monkeypatch, caplog):
    monkeypatch.setenv("MOEPAGE_LOG_EVERY", "2")
    module = ToyExperts(8, 16, 8, 2)
    moepage.wrap(module, resident=4, name="L0")
    with caplog.at_level(logging.INFO, logger="moepage"):
        for _ in range(2):
            module(torch.randn(3, 16), torch.tensor([[0, 5], [7, 1], [2, 3]]), torch.rand(3, 2))
    (record,) = [r for r in caplog.records if r.name == "moepage"]
    assert record.getMessage().startswith("layer L0: steps 2,")
