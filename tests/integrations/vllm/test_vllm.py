"""moepage's vLLM plugin, tested against the real vLLM 0.33.0 package: the cases (``vllm_cases.py``) run in a process
of their own with vLLM from a folder the tests make (``helpers.vllm_site``: vLLM pins torch 2.14.0, this environment
has 2.14.1). Each case is reported here by name; a case that fails or is skipped there fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import vllm_site

CASES = Path(__file__).with_name("vllm_cases.py")


@pytest.fixture(scope="module")
def outcome():
    """The cases' run: {case: outcome} and pytest's output."""
    run = vllm_site.run_cases(CASES, "-rA")
    results = dict(re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", run.stdout, re.M))
    by_case = {case.split("::", 1)[-1]: status for status, case in
               re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", run.stdout, re.M)}
    assert results or run.returncode == 0, f"the vLLM cases did not run:\n{run.stdout[-6000:]}\n{run.stderr[-6000:]}"
    return by_case, run


def _collected() -> list[str]:
    """The case names, read from the file (no vLLM import here)."""
    return re.findall(r"^def (test_\w+)", CASES.read_text(), re.M)


@pytest.mark.parametrize("case", _collected())
def test_vllm_case(case, outcome):
    by_case, run = outcome
    statuses = {name: status for name, status in by_case.items() if name.split("[", 1)[0] == case}
    assert statuses, f"{case} did not run:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    bad = {name: status for name, status in statuses.items() if status != "PASSED"}
    assert not bad, f"{bad}:\n{run.stdout[-12000:]}"


def test_every_case_ran_and_passed(outcome):
    by_case, run = outcome
    assert run.returncode == 0 and by_case and set(by_case.values()) == {"PASSED"}, run.stdout[-12000:]
