"""``integrations.flags``: the one table of the engine plugins' options, the views SGLang's and vLLM's settings make of
it, and what ``moepage.wrap`` documents of the same knobs; ``integrations.settle``: the one sequence in which both
plugins settle a layer's K and disk tier."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

import moepage
from moepage.config import SGLANG, VLLM
from moepage.errors import ConfigError
from moepage.integrations import flags, session
from moepage.integrations.session import DiskTier
from moepage.integrations.settle import settle
from moepage.integrations.sglang.settings import FLAGS
from moepage.integrations.vllm.settings import OPTIONS
from moepage.residency import policy_names

ROOT = Path(__file__).resolve().parents[2]


def _help(options: dict, engine: str) -> str:
    """An engine's help text in neutral words: its own words (``flags.ENGINES``) and its variable taken out."""
    text = re.sub(r"\s*Environment: \w+\.$", "", options["help"])
    for key, words in flags.ENGINES[engine].items():
        text = text.replace(words, "{" + key + "}")
    return text


def test_an_option_both_engines_take_says_the_same_to_each_in_its_own_words():
    shared = [o for o in flags.OPTIONS.values() if {SGLANG, VLLM} <= set(o.engines)]
    assert {"policy", "split", "compress", "host_budget", "spill_dir", "host_warm", "cpu_share", "prefetch"} <= {
        o.key for o in shared}
    for option in shared:
        sglang, vllm = FLAGS[option.dest].options, OPTIONS[option.key].options
        assert _help(sglang, SGLANG) == _help(vllm, VLLM), option.key
        assert {k: v for k, v in sglang.items() if k != "help"} == {k: v for k, v in vllm.items() if k != "help"}


def test_the_engines_views_derive_their_names_from_the_key():
    for option in flags.OPTIONS.values():
        if SGLANG in option.engines:
            flag = FLAGS[option.dest]
            assert (flag.flag, flag.attr) == (option.flag, f"_moepage_paged_experts_{option.key}")
            assert flag.env is option.env  # every SGLang flag has its variable
        if VLLM in option.engines:
            assert OPTIONS[option.key].flag == "--paged-experts-" + option.key.replace("_", "-")
    assert list(OPTIONS) == ["num_resident", "policy", "split", "compress", "host_budget", "spill_dir", "host_warm",
                             "cpu_share", "prefetch"]  # vLLM's additional_config keys
    # A variable applies where its Setting says: MOEPAGE_SGLANG_PREFETCH is SGLang's alone.
    assert FLAGS["paged_experts_prefetch"].env.name == "MOEPAGE_SGLANG_PREFETCH"
    assert OPTIONS["prefetch"].env is None and OPTIONS["num_resident"].env is None
    assert "paged_experts_num_resident" not in FLAGS  # SGLang's own flag
    assert all(f"Environment: {f.env.name}." in f.options["help"] for f in FLAGS.values())


def test_every_help_and_wraps_docstring_name_every_policy():
    names = policy_names().split(", ")
    assert "lruf" in names and "lruf:H" in names
    for options in (*FLAGS.values(), *OPTIONS.values()):
        if options.key == "policy":
            assert all(name in options.options["help"] for name in names), options.options["help"]
    bullet = re.search(r"`policy`: (.*?)\n- ", (ROOT / "docs" / "reference.md").read_text(), re.S).group(1)
    assert all(f'`"{name}"`' in bullet for name in names), bullet


def test_wrap_documents_the_knobs_the_engines_take():
    doc, params = moepage.wrap.__doc__, inspect.signature(moepage.wrap).parameters
    for option in flags.OPTIONS.values():
        if option.wrap is None:
            continue
        assert option.wrap in params and f"``{option.wrap}``" in doc, option.key
        if option.values:
            bullet = re.search(rf"- ``{option.wrap}``: (.*?)\n    - ", doc, re.S).group(1)
            assert all(f'"{value}"' in bullet for value in option.values), (option.key, bullet)


# -- the settle sequence ------------------------------------------------------------------------------------------
def _tier(budget: int) -> DiskTier:
    return DiskTier("/nonexistent/rows", 0, "lfu", budget=budget, where=f"--paged-experts-host-budget {budget}")


def test_settle_takes_k_then_the_tier_then_its_h_against_that_k(monkeypatch, tmp_path):
    monkeypatch.setattr(session, "next_layer_index", lambda: 0)
    order = []

    def auto():
        order.append("K")
        return 3

    def tier():
        order.append("tier")
        return _tier(4)

    settled = settle("layer0", 8, 2, "auto", auto=auto, split=None, tier=tier, warm=None)
    assert order == ["K", "tier"] and settled.k == 3 and settled.tier == _tier(4).settled("layer0", 3, 8)
    assert settle("layer0", 8, 2, 3, auto=lambda: pytest.fail("K is given"), split=None, tier=lambda: None,
                  warm=None).tier is None
    # A split file's K for this layer is the one H is checked against (not the flag's).
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"layers": {"0": 6, "1": 2}, "budget": 8}))
    assert settle("layer0", 8, 2, 4, auto=auto, split=str(split), tier=lambda: _tier(6), warm=None).k == 6
    with pytest.raises(ConfigError, match="fewer than its K=6 slots"):
        settle("layer0", 8, 2, 4, auto=auto, split=str(split), tier=lambda: _tier(4), warm=None)
