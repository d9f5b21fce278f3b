"""Per-layer slot budgets (``moepage.planning.budgets``): the exact allocation against brute force on
non-convex curves, miss curves against replay, the split file and ``moepage plan --trace``."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moepage import ConfigError, cli
from moepage.planning import budgets, synthetic, traces


def small_trace(seed: int = 0, steps: int = 120) -> traces.Trace:
    """Three layers of 12 experts, top-2, with different popularity skews (so splits differ)."""
    rng = np.random.default_rng(seed)
    pop = np.stack([synthetic._cap(rng.permutation(1.0 / np.arange(1, 13) ** a), 2) for a in (0.0, 1.0, 2.5)])
    return synthetic.synthetic_trace(synthetic.RoutingGenerator(pop, 2, 0.2, seed), steps)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_allocation_is_exact_on_any_curves(data):
    layers = data.draw(st.integers(1, 4))
    choices = data.draw(st.integers(1, 5))
    k_min = data.draw(st.integers(1, 3))
    curves = [data.draw(st.lists(st.integers(0, 50), min_size=choices, max_size=choices)) for _ in range(layers)]
    budget = data.draw(st.integers(layers * k_min, layers * (k_min + choices - 1)))
    ks = budgets.allocate(curves, budget, k_min)
    assert sum(ks) == budget and all(k_min <= k < k_min + choices for k in ks)
    got = sum(c[k - k_min] for c, k in zip(curves, ks))
    best = min(sum(c[j] for c, j in zip(curves, js)) for js in itertools.product(range(choices), repeat=layers)
               if sum(js) + layers * k_min == budget)
    assert got == best


def test_allocation_beats_greedy_on_a_non_convex_curve():
    """Layer 0 gains nothing from its first extra slot and 10 from its second: greedy marginal
    gain gives both slots to layer 1 (1 + 1); the optimum gives them to layer 0 (10)."""
    curves = [[20, 20, 10], [20, 19, 18]]
    assert budgets.allocate(curves, 4, 1) == [3, 1]
    for bad in (1, 7):
        with pytest.raises(ValueError):
            budgets.allocate(curves, bad, 1)


def test_curves_equal_replay_and_split_beats_uniform():
    trace = small_trace()
    curves = budgets.miss_curves(trace, "lfu")
    for k in (2, 5, 12):
        assert [c[k - 2] for c in curves] == traces.replay(trace, k, "lfu").layer_misses
    split = budgets.plan_split(trace, 3 * 5, "lfu", curves=curves)
    assert sum(split.layers) == 15 and split.layers != [5, 5, 5]
    assert split.misses < split.uniform_misses()
    assert split.misses == budgets.replay_split(trace, split.layers, "lfu")  # per-layer replay agrees
    assert split.layers[2] < split.layers[0]  # the most skewed layer needs the fewest slots


def test_split_file_round_trip_and_rebudget(tmp_path):
    trace = small_trace()
    split = budgets.plan_split(trace, 18, "lru")
    path = tmp_path / "split.json"
    budgets.save_split(split, path)
    data = json.loads(path.read_text())
    assert data["budget"] == 18 and data["policy"] == "lru" and data["top_k"] == 2
    assert budgets.load_split(path) == dict(enumerate(split.layers))
    assert budgets.load_split(path, budget=24) \
        == dict(enumerate(budgets.plan_split(trace, 24, "lru", curves=split.curves).layers))
    path.write_text(json.dumps({"layers": {"model.layers.0.mlp.experts": 4, "1": 6}}))
    assert budgets.load_split(path) == {"model.layers.0.mlp.experts": 4, 1: 6}
    with pytest.raises(ValueError):
        budgets.load_split(path, budget=10)  # no curves to re-split from
    path.write_text(json.dumps({"layers": {"0": 0}}))
    with pytest.raises(ValueError):
        budgets.load_split(path)


def test_cli_plan_trace(tmp_path, capsys):
    trace_path, out = tmp_path / "t.npz", tmp_path / "split.json"
    ids = synthetic.synthetic_ids(synthetic.RoutingGenerator(
        np.stack([synthetic._cap(1.0 / np.arange(1, 9) ** a, 2) for a in (0.0, 2.0)]), 2, 0.0, 1), 80)
    traces.save_simple(trace_path, ids, 8, 2)
    assert cli.main(["plan", "--trace", str(trace_path), "--budget", "0.5", "--policy", "lru", "--out", str(out),
                     "--jobs", "1"]) == 0
    text = capsys.readouterr().out
    assert "budget 8 slots" in text and "layer   1: K =" in text and "uniform K = 4" in text
    split = budgets.load_split(out)
    assert sum(split.values()) == 8 and split[0] > split[1]  # the uniform layer gets more than the skewed one
    assert cli.main(["plan", "--trace", str(trace_path)]) == 2  # no budget
    assert cli.main(["plan", "--trace", str(trace_path), "--budget", "40"]) == 2  # more than L x E
    assert "moepage plan" in capsys.readouterr().err


@pytest.mark.parametrize("jobs", [1, 2])
def test_miss_curves_report_progress_in_k_order(jobs):
    """The CLI draws its bar from these calls; in a pool as without one, one call per K, results unchanged."""
    trace = small_trace(steps=30)
    calls = []
    curves = budgets.miss_curves(trace, jobs=jobs, progress=lambda done, total: calls.append((done, total)))
    n = trace.num_experts - trace.top_k + 1
    assert calls == [(i, n) for i in range(1, n + 1)]
    assert curves == budgets.miss_curves(trace)


def test_replay_grid_and_synthetic_ids_report_progress():
    trace = small_trace(steps=30)
    calls = []
    results = traces.replay_grid(trace, [2, 3, 6], ["lru", "lfu"], progress=lambda d, t: calls.append((d, t)))
    assert len(results) == 6 and calls == [(i, 6) for i in range(1, 7)]
    calls.clear()
    with pytest.raises(ConfigError, match="K=1 is below top_k=2, outside top_k=2..num_experts=12"):
        traces.replay_grid(trace, [1, 3], ["lru"], progress=lambda d, t: calls.append((d, t)))
    assert calls == []  # refused before any replay, not skipped
    calls.clear()
    gen = synthetic.uniform(2, 8, 2, 0.3, 0)
    ids = synthetic.synthetic_ids(gen, 5, batch=2, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (10, 10) and [d for d, _ in calls] == sorted({d for d, _ in calls})
    assert np.array_equal(ids, synthetic.synthetic_ids(gen, 5, batch=2))


def test_parse_budget_says_both_forms():
    with pytest.raises(ValueError, match=r"budget 'abc' is neither a total slot count over all layers \(512\) "
                                         r"nor a K/E fraction \(0.5\)"):
        budgets.parse_budget("abc", small_trace(steps=5))
    assert budgets.parse_budget(" 12 ", small_trace(steps=5)) == 12
