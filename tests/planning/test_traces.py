"""Trace replay (``moepage.planning.traces`` + ``moepage.planning.policies``), the synthetic generator and the
``moepage trace`` / ``moepage synth`` CLI, on CPU. Real traces are read from
``../shared/data/traces`` (or ``$MOEPAGE_TRACES``); those tests skip, saying so, when it is absent."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.data import CALIBRATION_SOURCE, REAL_TRACES, SHARED_TRACES, load_real, needs_traces
from helpers.reference import RefLRU
from moepage import cli
from moepage.planning import synthetic, traces
from moepage.planning.policies import canonical, make_residency
from moepage.planning.traces import Trace, hottest, replay
from moepage.residency import LRU, Residency, plan_waves

POLICIES = ("lru", "lfu", "lfru", "lfu:2", "belady")


@functools.cache
def real(spec: str, steps: int = 400) -> Trace:
    return traces.load_trace(SHARED_TRACES / spec,
                             num_experts=REAL_TRACES.get(spec.replace("#dec", ""))).window(0, steps)


# -- independent models --------------------------------------------------------------------------
def ref_lru_replay(trace: Trace, k: int) -> tuple[int, int]:
    """Hits and misses of a cold LRU replay through conftest's from-scratch ``RefLRU``."""
    hits = misses = 0
    for steps in trace.layers:
        ref = RefLRU(trace.num_experts, k)
        ref.forget(range(k))
        for experts in steps:
            for served, loads in ref.step(experts):
                hits += len(served) - len(loads)
                misses += len(loads)
    return hits, misses


def optimum(steps: list[tuple[int, ...]], k: int) -> int:
    """Most hits any victim choice can get under ``plan_waves`` (exhaustive; tiny inputs only).
    Empty slots are used before any eviction (evicting instead never helps)."""

    @functools.cache
    def step(t: int, res: frozenset) -> int:
        if t == len(steps):
            return 0
        order = [e for e in steps[t] if e in res] + [e for e in steps[t] if e not in res]
        return wave(t, tuple(tuple(order[i : i + k]) for i in range(0, len(order), k)), 0, res)

    @functools.cache
    def wave(t: int, waves: tuple, i: int, res: frozenset) -> int:
        if i == len(waves):
            return step(t + 1, res)
        w = set(waves[i])
        evict = max(0, len(w - res) - (k - len(res)))
        return len(w & res) + max(
            wave(t, waves, i + 1, frozenset((res - set(ev)) | w))
            for ev in itertools.combinations(sorted(res - w), evict)
        )

    return step(0, frozenset())


@st.composite
def small_traces(draw, single_wave: bool):
    e = draw(st.integers(2, 7))
    k = draw(st.integers(1, e))
    width = k if single_wave else e
    steps = draw(st.lists(st.lists(st.integers(0, e - 1), min_size=1, max_size=width, unique=True),
                          min_size=1, max_size=9))
    layer = [tuple(sorted(s)) for s in steps]
    return Trace("random", e, 1, [layer]), k


# -- replay semantics ----------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(small_traces(single_wave=False))
def test_lru_replay_equals_independent_lru(case):
    trace, k = case
    r = replay(trace, k, "lru")
    assert (r.hits, r.misses) == ref_lru_replay(trace, k)
    assert r.hits + r.misses == sum(len(s) for s in trace.layers[0])


@settings(max_examples=150, deadline=None)
@given(small_traces(single_wave=True))
def test_belady_is_the_optimum_when_steps_fit_one_wave(case):
    trace, k = case
    best = replay(trace, k, "belady").hits
    assert best == optimum(trace.layers[0], k)
    for p in POLICIES:
        assert replay(trace, k, p).hits <= best, p


@settings(max_examples=100, deadline=None)
@given(small_traces(single_wave=False))
def test_every_policy_within_the_exhaustive_optimum(case):
    # Multi-wave steps: the planner fixes all but the last wave's leftovers, so Belady is not
    # always optimal there (see moepage.planning.policies); nothing beats the exhaustive optimum, though.
    trace, k = case
    best = optimum(trace.layers[0], k)
    for p in POLICIES:
        assert replay(trace, k, p).hits <= best, p


def test_k_equals_e_gives_only_compulsory_misses():
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(16)[:3] for _ in range(300)]).reshape(100, 3, 3)
    trace = traces.from_array("t", ids, 16, 3)
    for p in POLICIES:
        assert replay(trace, 16, p).misses == trace.compulsory_misses()
        assert replay(trace, 16, p, warm=True).misses == 0


def test_policy_names():
    res = make_residency("lru", 8, 4)
    assert res.policy == LRU and res.chooser is None  # replay runs the planner's own rule
    assert make_residency("lfu:7", 8, 4).policy.half_life == 7
    assert canonical("MIN") == "belady" and canonical("lfu:1024") == "lfu" and canonical("lfru:5") == "lfru:5"
    for bad in ("fifo", "lfu:0", "lru:3", "lfu:x"):
        with pytest.raises(ValueError):
            canonical(bad)


def test_bad_policy_victims_are_refused():
    class Bad:
        def victims(self, res, experts, candidates, count):
            return candidates[:1] * count

    res = Residency(6, 3, chooser=Bad())
    with pytest.raises(ValueError):
        plan_waves(res, [3, 4, 5])


# -- real traces ---------------------------------------------------------------------------------
SHAPES = {  # spec: (E, top_k, layers, steps of the whole trace)
    "granite_1b_a400m_onnxgenai/moe_expert_trace.json": (32, 8, 24, 195),
    "granite_1b_a400m_onnxgenai/moe_expert_trace.json#decode": (32, 8, 24, 192),
    "flame_moe_290m_dynande/flame_moe_290m_routing.npz": (64, 6, 8, 2688),
    "flame_moe_290m_dynande/flame_moe_290m_routing.npz#dec": (64, 6, 8, 640),
    "qwen15moe_vllm_totaniyash/moe_routes.jsonl": (60, 4, 1, 104),
    "unknown_12L_64E_top1_exflow_format/trace.npy": (64, 1, 12, 2048),
}


@needs_traces
@pytest.mark.parametrize("spec", list(SHAPES))
def test_real_trace_replay(spec):
    full = traces.load_trace(SHARED_TRACES / spec, num_experts=REAL_TRACES.get(spec.replace("#dec", "")))
    assert (full.num_experts, full.top_k, len(full.layers), full.num_steps) == SHAPES[spec]
    trace = real(spec)
    assert all(0 <= e < trace.num_experts for layer in trace.layers for s in layer for e in s)
    routed = sum(len(s) for layer in trace.layers for s in layer)
    for frac in ("0.25", "0.5", "0.75"):
        k = traces.resolve_k(frac, trace.num_experts)
        rows = {p: replay(trace, k, p) for p in POLICIES}
        for r in rows.values():
            assert r.hits + r.misses == routed and 0.0 < r.hit_rate < 1.0
            assert r.misses >= trace.compulsory_misses()
        for p in POLICIES:
            assert rows[p].hits <= rows["belady"].hits, (spec, frac, p)
    assert replay(trace, trace.num_experts, "lru").misses == trace.compulsory_misses()


def test_replay_admits_prefill_steps_only():
    """Steps 0 and 4 are prefills of 6 distinct experts (K = 3): with admit=1 each evicts one
    occupied slot; decode steps are never capped."""
    layer = [(0, 1, 2, 3, 4, 5), (0,), (1,), (2,), (6, 7, 8, 9, 10, 11), (0,), (1,), (2,)]
    trace = Trace("mix", 12, 1, [layer], frozenset({0, 4}))
    plain, admitted = replay(trace, 3, "lru"), replay(trace, 3, "lru", admit=1)
    assert (plain.misses, plain.prefill_misses) == (6 + 3 + 6 + 3, 12)
    # admitted: empty slots are free to fill, so the cold prefill takes all three and 0, 1, 2
    # miss after it; the second prefill rotates through the oldest slot only (expert 0's), so
    # after it 0 misses and 1, 2 hit.
    assert (admitted.misses, admitted.prefill_misses) == (6 + 3 + 6 + 1, 12)
    assert replay(trace.window(1, 4), 3, "lru", admit=1).misses == replay(trace.window(1, 4), 3, "lru").misses
    assert trace.window(3, 8).prefill_steps == {1}


@needs_traces
def test_granite_prefill_steps_are_marked():
    full = load_real("granite_1b_a400m_onnxgenai/moe_expert_trace.json")
    assert sorted(full.prefill_steps) == [0, 65, 130]  # per prompt: one prefill step, 64 decode steps
    assert all(len(full.layers[0][t]) > full.top_k for t in full.prefill_steps)
    assert load_real("granite_1b_a400m_onnxgenai/moe_expert_trace.json#decode").prefill_steps == frozenset()
    plain, admitted = replay(full, 16, "lru"), replay(full, 16, "lru", admit=4)
    assert 0 < plain.prefill_misses < plain.misses and admitted.misses != plain.misses


@needs_traces
def test_profiling_runs_of_a_route_log_are_dropped():
    trace = load_real("qwen15moe_vllm_totaniyash/moe_routes.jsonl")
    assert (43, 5, 7, 58) not in trace.layers[0]  # the profiling runs' constant routing
    assert max(len(s) for s in trace.layers[0]) > 4  # calls batch several tokens


def test_simple_format_roundtrip(tmp_path):
    ids = np.array([[[0, 1], [2, 3]], [[1, -1], [3, 4]]])  # [steps, layers, n]; -1 is padding
    traces.save_simple(tmp_path / "t.npz", ids, num_experts=6, top_k=2)
    t = traces.load_trace(tmp_path / "t.npz")
    assert (t.num_experts, t.top_k) == (6, 2)
    assert t.layers == [[(0, 1), (1,)], [(2, 3), (3, 4)]]
    with pytest.raises(ValueError):
        traces.load_trace(f"{tmp_path / 't.npz'}#decode")


def test_resolve_k():
    assert traces.resolve_k("0.25", 32) == 8 and traces.resolve_k("12", 32) == 12
    assert traces.resolve_k("1.0", 60) == 60
    with pytest.raises(ValueError):
        traces.resolve_k("40", 32)


# -- synthetic generator -------------------------------------------------------------------------
def zipf_popularity(layers: int, e: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = np.stack([rng.permutation(1.0 / np.arange(1, e + 1) ** 1.1) for _ in range(layers)])
    return np.stack([synthetic._cap(r, k) for r in w])


@pytest.mark.parametrize("locality", [0.0, 0.5, 0.9])
def test_generator_matches_popularity(locality):
    gen = synthetic.RoutingGenerator(zipf_popularity(4, 32, 4), 4, locality, seed=3)
    ids = gen.generate(3000)
    assert ids.shape == (3000, 4, 4)
    assert all(len(set(row)) == 4 for row in ids.reshape(-1, 4))  # distinct experts per token
    measured = synthetic.marginals(ids, 32)
    assert np.corrcoef(measured.ravel(), gen.popularity.ravel())[0, 1] > 0.99
    assert abs(np.polyfit(gen.popularity.ravel(), measured.ravel(), 1)[0] - 1) < 0.05
    assert np.array_equal(ids, synthetic.RoutingGenerator(gen.popularity, 4, locality, seed=3).generate(3000))


def test_generator_calibrated_to_the_shipped_profile():
    gen = synthetic.calibrated(locality=0.3, seed=0)
    assert gen.popularity.shape == (48, 128) and gen.top_k == 8
    assert np.allclose(gen.popularity.sum(1), 8)
    measured = synthetic.marginals(gen.generate(1500), 128)
    assert np.corrcoef(measured.ravel(), gen.popularity.ravel())[0, 1] > 0.99


def test_locality_knob_raises_repeat_rate():
    pop = zipf_popularity(3, 32, 4, seed=1)
    rates = [synthetic.repeat_rate(synthetic.RoutingGenerator(pop, 4, rho, seed=0).generate(800))
             for rho in (0.0, 0.3, 0.6, 0.9)]
    assert rates == sorted(rates) and rates[-1] - rates[0] > 0.4
    uniform = synthetic.repeat_rate(synthetic.uniform(3, 32, 4, 0.0, seed=0).generate(2000))
    assert abs(uniform - 4 / 32) < 0.02  # independent uniform tokens share k/E of their experts


def test_synthetic_batch_trace():
    gen = synthetic.uniform(2, 16, 2, 0.0, seed=0)
    trace = synthetic.synthetic_trace(gen, 50, batch=4)
    assert trace.num_steps == 50 and all(2 <= len(s) <= 8 for s in trace.layers[0])


# -- CLI -----------------------------------------------------------------------------------------
def test_cli_synth_then_trace(tmp_path, capsys):
    out = tmp_path / "s.npz"
    assert cli.main(["synth", str(out), "--uniform", "--layers", "2", "--experts", "16", "--top-k", "2",
                     "--tokens", "200", "--locality", "0.5"]) == 0
    assert cli.main(["trace", str(out), "--k", "0.25,0.5,8", "--policies", "lru,lfu,lfru:8,belady"]) == 0
    text = capsys.readouterr().out
    assert "belady" in text and "lfru:8" in text and " 0.25 " in text and " 0.50 " in text


def test_cli_trace_png(tmp_path):
    import matplotlib  # noqa: F401  (the [test] extra installs it)
    ids = np.random.default_rng(0).integers(0, 8, size=(50, 2, 1))
    traces.save_simple(tmp_path / "t.npz", ids, 8, 1)
    assert cli.main(["trace", str(tmp_path / "t.npz"), "--png", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_reports_bad_input(tmp_path, capsys):
    assert cli.main(["trace", str(tmp_path / "missing.npy")]) == 2
    assert "moepage trace" in capsys.readouterr().err


# -- the shipped calibration ----------------------------------------------------------------------
def test_synth_needs_no_file_outside_the_package(tmp_path, monkeypatch, capsys):
    """The default calibration is package data: no shared traces, any working directory (it was
    read from the repository's ../shared)."""
    monkeypatch.setenv("MOEPAGE_TRACES", str(tmp_path / "no-traces-here"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["synth", "s.npz", "--tokens", "20"]) == 0
    assert "E=128, top_k=8" in capsys.readouterr().out and (tmp_path / "s.npz").exists()


def test_synth_says_what_to_do_without_its_calibration(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(synthetic, "CALIBRATION", "data/missing.json")
    assert cli.main(["synth", str(tmp_path / "s.npz")]) == 2
    err = capsys.readouterr().err
    assert "missing" in err and "--calibration" in err and "--uniform" in err


def test_shipped_calibration_is_the_shared_aggregates_heat():
    shared = SHARED_TRACES / CALIBRATION_SOURCE
    if not shared.exists():
        pytest.skip(f"shared aggregates not found at {shared}")
    packaged, k = synthetic.load_popularity()
    original, k0 = synthetic.load_popularity(shared)
    assert k == k0 == 8 and packaged.shape == (48, 128) and np.array_equal(packaged, original)


def test_a_trace_is_named_by_its_folder_and_stem(tmp_path, monkeypatch):
    """A file in the working directory is named by its stem alone (it was ``/trace``, read as an absolute path)."""
    ids = np.array([[[0, 1]], [[1, 2]]])
    (tmp_path / "runs").mkdir()
    traces.save_simple(tmp_path / "runs" / "trace.npz", ids, 4, 2)
    monkeypatch.chdir(tmp_path / "runs")
    assert traces.load_trace("trace.npz").name == "trace"
    monkeypatch.chdir(tmp_path)
    assert traces.load_trace("runs/trace.npz").name == "runs/trace"


def test_hottest_ranks_a_layer_s_experts_by_the_steps_that_route_them():
    """Most routed first, ties by the lower id, never an expert the layer never routes, at most ``count``."""
    layers = [[(3, 5), (5,), (1, 5), (1, 3)], [(0,), (0,), (7,), (7,)]]
    trace = Trace("t", 8, 2, layers)
    assert hottest(trace, 0, 8) == [5, 1, 3]  # 5 in three steps, then 1 and 3 in two (1 first)
    assert hottest(trace, 0, 2) == [5, 1]
    assert hottest(trace, 1, 3) == [0, 7]


def test_a_host_tier_warmed_from_the_trace_starts_with_its_most_routed_experts():
    """``replay(host_slots=H, host_warm=T)``: each layer's host tier holds the H experts T routes to most in that
    layer before the first step, so a layer routing only those reads nothing from disk (cold: each once)."""
    layers = [[(1, 2), (2, 3), (1, 3)] * 4, [(5, 6)] * 12]
    trace = Trace("t", 8, 2, layers)
    cold = replay(trace, 2, "lru", host_slots=3)
    warmed = replay(trace, 2, "lru", host_slots=3, host_warm=trace)
    assert cold.host_misses == 3 + 2 and warmed.host_misses == 0
    assert warmed.misses == cold.misses  # the device tier is the same either way
    other = Trace("o", 8, 2, [[(0, 4)] * 3, [(0, 7)] * 3])  # another workload's experts: no help here
    assert replay(trace, 2, "lru", host_slots=3, host_warm=other).host_misses == cold.host_misses
