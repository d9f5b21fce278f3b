"""``moepage.config``: the one table of ``MOEPAGE_*`` variables (flags in any usual spelling, a
``ConfigError`` naming the variable and the value for anything else), ``PagingConfig`` and the
rules checked once (K, admission, prefetch values), and ``Problems`` saying a problem common to
several layers once."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import moepage
from moepage.backends.mock import MockStore
from moepage.config import ENV, PagingConfig, Problems, Setting, env, parse_prefetch
from moepage.residency import k_problem
from moepage.toy import ToyExperts, ToyMoE

FLAG = Setting("MOEPAGE_TEST_FLAG", ENV["MOEPAGE_VERIFY"].parse, False, "a flag")
INT = Setting("MOEPAGE_TEST_VAR", ENV["MOEPAGE_LOG_EVERY"].parse, 7, "a whole number")
FRACTION = Setting("MOEPAGE_TEST_VAR", ENV["MOEPAGE_KV_RESERVE_FRACTION"].parse, 0.25, "a fraction")
CHOICE = Setting("MOEPAGE_TEST_VAR", ENV["MOEPAGE_BACKEND"].parse, "x", "a choice")


@pytest.mark.parametrize("text,value", [
    ("1", True), ("true", True), ("TRUE", True), ("Yes", True), ("on", True), (" 1 ", True),
    ("0", False), ("false", False), ("No", False), ("OFF", False),
])
def test_flag_spellings(monkeypatch, text, value):
    monkeypatch.setenv("MOEPAGE_TEST_FLAG", text)
    assert FLAG.read() is value


def test_unset_or_empty_gives_the_default(monkeypatch):
    monkeypatch.delenv("MOEPAGE_TEST_VAR", raising=False)
    assert INT.read() == 7 and CHOICE.read() == "x"
    monkeypatch.setenv("MOEPAGE_TEST_VAR", "  ")
    assert FRACTION.read() == 0.25


@pytest.mark.parametrize("setting,text,fragment", [
    (FLAG, "maybe", "1/0, true/false"),
    (INT, "abc", "whole number >= 0"),
    (INT, "-2", "whole number >= 0"),
    (FRACTION, "25%", "number in [0, 1)"),
    (FRACTION, "1.5", "number in [0, 1)"),
    (FRACTION, "nan", "number in [0, 1)"),
    (CHOICE, "gpu", "one of cuda, torch, mock"),
])
def test_bad_values_name_the_variable_and_the_value(monkeypatch, setting, text, fragment):
    monkeypatch.setenv(setting.name, text)
    with pytest.raises(moepage.ConfigError) as info:
        setting.read()
    assert f"{setting.name}={text!r}" in str(info.value) and fragment in str(info.value)


def test_every_variable_is_in_the_one_table(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
        assert env(name) == ENV[name].default
    from moepage.integrations.sglang.settings import FLAGS

    names = {f.env.name for f in FLAGS.values()}
    assert {"MOEPAGE_POLICY", "MOEPAGE_SPLIT", "MOEPAGE_SGLANG_IMPL", "MOEPAGE_SGLANG_PREFETCH"} <= names


def test_the_k_rule():
    assert k_problem(4, 8, 2) is None and k_problem(8, 8, 8) is None
    assert "outside top_k=2..num_experts=8" in k_problem(9, 8, 2)
    assert "below top_k=2, outside top_k=2..num_experts=8" in k_problem(0, 8, 2)
    assert "below top_k=4" in k_problem(3, 8, 4)
    assert "outside 1..num_experts=8" in k_problem(0, 8, None)  # top_k unknown: the floor is 1


@pytest.mark.parametrize("value,want", [(None, False), (False, False), ("off", False), ("", False), (True, True),
                                        ("on", True), ("ON", True), (3, 3), ("3", 3)])
def test_prefetch_values(value, want):
    assert parse_prefetch(value) == want


@pytest.mark.parametrize("value", [0, -1, "zero", "0", 2.5, "maybe"])
def test_bad_prefetch_values(value):
    with pytest.raises(ValueError, match="use off, on"):
        parse_prefetch(value)


def test_paging_config_reads_the_environment_for_what_is_unset(monkeypatch):
    monkeypatch.setenv("MOEPAGE_POLICY", "lru")
    monkeypatch.setenv("MOEPAGE_VERIFY", "yes")
    problems = Problems()
    config = PagingConfig.from_options(problems)
    assert not problems and config.policy.name == "lru" and config.verify is True
    assert PagingConfig.from_options(problems, policy="lfru", verify=False).verify is False
    assert PagingConfig(policy="lfu").policy.half_life == 1024  # a name is read as its policy


def test_a_problem_common_to_all_layers_is_said_once():
    """One bad K on a model of 6 layers: one line naming them, not six lines."""
    model = ToyMoE(layers=6, num_experts=8, top_k=4)
    with pytest.raises(moepage.ConfigError) as info:
        moepage.wrap(model, resident=3, backend="mock")
    lines = str(info.value).splitlines()[1:]
    assert len(lines) == 1 and lines[0].startswith("  - all 6 layers (blocks.0.experts (ToyExperts), ") \
        and "below top_k=4" in lines[0], lines
    problems = Problems()
    for layer in ("a", "b"):
        problems.add("too small", layer)
    problems.add("unrelated")
    assert problems.lines(total_layers=3) == ["2 layers (a, b): too small", "unrelated"]
    for layer in "cdefgh":
        problems.add("too small", layer)
    assert problems.lines(total_layers=8)[0] == "all 8 layers (a, b, c, d and 4 more): too small"


def test_verify_accepts_true(monkeypatch):
    monkeypatch.setenv("MOEPAGE_VERIFY", "true")  # was: ValueError from int()
    module = ToyExperts(8, 16, 8, 2)
    moepage.wrap(module, resident=4, backend="mock")
    assert next(moepage.paged_layers(module)).pager.config.verify is True


@pytest.mark.parametrize("name,value", [("MOEPAGE_VERIFY", "maybe"), ("MOEPAGE_LOG_EVERY", "often"),
                                        ("MOEPAGE_SKIP_EMPTY_WAVES", "sometimes")])
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


@pytest.mark.parametrize("value,want", [("no", False), ("off", False), ("yes", True), (True, True), (0, False)])
def test_verify_strings_are_read_as_flags(monkeypatch, value, want):
    """``verify="no"`` turned verification on (a non-empty string is truthy)."""
    monkeypatch.setenv("MOEPAGE_VERIFY", "1")  # an explicit verify= wins over the environment
    module = ToyExperts(8, 16, 8, 2)
    moepage.wrap(module, resident=4, backend="mock", verify=value)
    assert next(moepage.paged_layers(module)).pager.config.verify is want


@pytest.mark.parametrize("value,fragment", [("maybe", "verify='maybe' is not a flag (1/0, true/false"),
                                            (2, "verify must be True or False (or 'on' / 'off'), got 2 (int)")])
def test_bad_verify_values_are_refused(value, fragment):
    store = MockStore()
    with pytest.raises(moepage.ConfigError, match=re.escape(fragment)):
        moepage.wrap(ToyExperts(8, 16, 8, 2), resident=4, backend=store, verify=value)
    assert store.host_bytes() == 0


@pytest.mark.parametrize("option", ["device_planner", "prefill_overlap"])
def test_other_on_off_options_read_strings_as_flags(option):
    """``device_planner="no"`` and ``prefill_overlap="no"`` are off (a non-empty string is truthy), and a value
    that is no flag is refused before anything is allocated."""
    module = ToyExperts(8, 16, 8, 2)
    moepage.wrap(module, resident=4, backend="mock", **{option: "no"})
    config = next(moepage.paged_layers(module)).pager.config
    assert (config.device_planner if option == "device_planner" else config.overlap) is False
    store = MockStore()
    with pytest.raises(moepage.ConfigError, match=re.escape(f"{option}='maybe' is not a flag")):
        moepage.wrap(ToyExperts(8, 16, 8, 2), resident=4, backend=store, **{option: "maybe"})
    assert store.host_bytes() == 0


def test_a_list_cut_in_a_message_says_how_many_more():
    from moepage.config import listed

    assert listed(["a", "b"]) == "a, b"
    assert listed("abcdefgh") == "a, b, c and 5 more"
    assert listed(range(10), 8, "; ") == "0; 1; 2; 3; 4; 5; 6; 7 and 2 more"
