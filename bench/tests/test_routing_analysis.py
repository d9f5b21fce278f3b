"""The committed tiny trained Qwen3-MoE (``tests/data/tiny_moe``, from ``python -m
bench.models.train_moe --preset tiny``): it loads with transformers and with moepage's loader,
paged equals unpaged, and its routing is learned: more skewed than a random model of the same
config, and predictable one layer ahead far above chance (what the router prefetch relies on).

The routing is measured on held-out stdlib source (``bench.models.train_moe.corpus("val")``) of whatever
Python runs the tests, so the thresholds leave room for another Python's stdlib.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors  # noqa: F401  (the [test] extra installs it)
import torch
import transformers  # noqa: F401  (the [test] extra installs it)

from bench.analysis import routing_analysis as ra

CKPT = Path(__file__).resolve().parents[2] / "tests" / "data" / "tiny_moe"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def routing():
    """Analysis of the trained checkpoint and of random models of its config (two seeds: a random
    model's skew varies by seed), on the same held-out text."""
    ids = ra.sample(windows=8, seq=256)
    return ra.analyse(ra.load(str(CKPT)), ids), [ra.analyse(ra.load(str(CKPT), random_init=True, seed=s), ids)
                                                 for s in (0, 1)]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _entropy(res) -> float:
    return _mean(p["entropy_bits"] for p in res["popularity"])


def _recall_one_ahead(res) -> float:
    return ra.mean_recall(res["recall"], 1, "post_ln", res["top_k"])


def test_routing_is_more_skewed_than_random_init(routing):
    """A random model routes by a hash of the byte (the residual stream carries the embedding), and
    bytes are skewed, so random routing on real text is itself skewed: the margin over it is small
    but above the spread between random seeds. The entropies this sample gave, and Qwen3-30B-A3B's decode heat:
    docs/results-history.md, 'Figures once stated in bench code comments' and 2026-11-30's routing section."""
    trained, randoms = routing
    uniform = trained["popularity"][0]["uniform_bits"]
    assert _entropy(trained) < _mean(map(_entropy, randoms)) - 0.1, (_entropy(trained), [_entropy(r) for r in randoms])
    assert _entropy(trained) < 0.9 * uniform, (_entropy(trained), uniform)


def test_routing_is_predictable_one_layer_ahead(routing):
    trained, randoms = routing
    k, e = trained["top_k"], trained["num_experts"]
    chance = k / e
    for variant in ra.VARIANTS:
        recall = ra.mean_recall(trained["recall"], 1, variant, k)
        # The trained model's recall is well above both bounds (bench/RESULTS.md, 'Learned routing predictability').
        assert recall >= 0.6 and recall >= 4 * chance, (variant, recall, chance)
    # Learned, not inherited from the embedding: random models reach less (the same section's random-init column).
    assert _recall_one_ahead(trained) > _mean(map(_recall_one_ahead, randoms)) + 0.05
    # The router predicts more than the skew alone does: always guessing each layer's k most popular
    # experts (on the same layers, in-sample) reaches far less (the same section's 'popular' row).
    targets = range(1, trained["layers"])
    popular = _mean(ra.mean_recall(trained["recall"], 0, "popular", k, t) for t in targets)
    assert _recall_one_ahead(trained) > popular + 0.2, popular


def test_moe_in_is_the_prefetch_predictor(routing):
    """``moe_in`` one ahead is layer T's router on exactly what layer T-1's experts module receives
    (``moepage.wrap(..., prefetch=True)``'s predictor), and it sees less than the residual leaving
    layer T-1: that state lacks layer T-1's expert output, most at layer 1 (layer 0's experts change the stream
    most). This sample's figures: docs/results-history.md, 'Figures once stated in bench code comments'."""
    trained, _ = routing
    k = trained["top_k"]
    model = ra.load(str(CKPT))
    layers = model.model.layers
    seen = {}
    hooks = [layer.mlp.experts.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0].clone()))
             for i, layer in enumerate(layers)]
    ids = ra.sample(windows=2, seq=64)
    try:
        rec = ra.record(model, ids)
    finally:
        for h in hooks:
            h.remove()
    actual, rows = rec.ids.reshape(len(layers), -1, k), ra.recall(model, rec)
    for t in range(1, len(layers)):
        assert torch.equal(seen[t - 1], rec.router_in[t - 1])  # the router's input is the experts' input
        pred = ra.router_topk(layers[t], seen[t - 1], 2 * k).numpy()
        mine = ra.overlap(pred[:, :k], actual[t]).mean()
        assert mine == ra.mean_recall(rows, 1, "moe_in", k, t)
    moe_in, raw = (ra.mean_recall(trained["recall"], 1, v, k) for v in ("moe_in", "raw"))
    assert moe_in < raw, (moe_in, raw)
    assert ra.mean_recall(trained["recall"], 1, "moe_in", 2 * k) >= 0.75
