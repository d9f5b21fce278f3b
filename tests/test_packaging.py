"""What ``pip install moepage`` ships besides the code: the license (SPDX metadata and full text),
``py.typed`` and the calibration data, declared in ``pyproject.toml`` and present in the tree."""

from __future__ import annotations

from pathlib import Path

import pytest

import moepage

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_spdx_apache_2_with_its_text():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    setuptools = int(PYPROJECT["build-system"]["requires"][0].partition(">=")[2])
    assert setuptools >= 77  # the first setuptools that reads an SPDX license string


def test_package_data_is_declared_and_present():
    declared = PYPROJECT["tool"]["setuptools"]["package-data"]["moepage"]
    assert {"py.typed", "planning/data/*.json"} <= set(declared)
    for pattern in declared:
        assert list((ROOT / "moepage").glob(pattern)), f"moepage/{pattern} matches no file"


def test_version_has_one_source():
    assert "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "moepage.__version__"}
    assert moepage.__version__ in (ROOT / "CHANGELOG.md").read_text()


def test_version_is_the_changelog_s_latest_release(capsys):
    import re

    import moepage
    from moepage.cli import main

    text = (Path(__file__).resolve().parents[1] / "CHANGELOG.md").read_text()
    released = re.findall(r"^## (\d+\.\d+\.\d+) - \d{4}-\d\d-\d\d$", text, flags=re.M)
    assert released and released[0] == moepage.__version__
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.split() == ["moepage", moepage.__version__]
    assert not re.search(r"\(?issues? \d+\)?|#\d+\b", text), "the changelog speaks in user terms"
