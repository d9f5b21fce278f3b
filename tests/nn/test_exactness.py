"""Paged == unpaged, bit for bit (``torch.equal``), for ToyExperts and the whole ToyMoE."""

from __future__ import annotations

import copy
import random
import zlib

import pytest
import torch

import moepage
from helpers.models import DTYPES, layer_of, make_experts
from helpers.routing import draw_routing, expected_waves, pool_for_waves, random_inputs
from moepage.backends.mock import MockStore
from moepage.toy import ToyExperts, ToyMoE

pytestmark = pytest.mark.usefixtures("single_thread")

E, H, I, TOP_K = 16, 32, 16, 2
STEPS = 3


def _cases():
    for impl in ("eager", "grouped_mm"):
        for pad in (False, True) if impl == "eager" else (False,):
            for dtype in DTYPES:
                for k in (TOP_K, 6, E):
                    for tokens in (1, 7, 64, 513):
                        for waves in ("one", "two", "many"):
                            if waves != "one" and (k == E or tokens * TOP_K <= k):
                                continue  # cannot route more than K distinct experts
                            yield pytest.param(impl, dtype, k, tokens, waves, pad,
                                               id=f"{impl}-{dtype}-K{k}-T{tokens}-{waves}{'-pad' if pad else ''}")


@pytest.mark.parametrize("impl,dtype,k,tokens,waves,pad", list(_cases()))
def test_toy_experts_exact(impl, dtype, k, tokens, waves, pad):
    seed = zlib.crc32(f"{impl}{dtype}{k}{tokens}{waves}{pad}".encode())
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    paged, ref = make_experts(E, H, I, TOP_K, impl, DTYPES[dtype], seed=seed)
    moepage.wrap(paged, resident=k, backend="mock")
    layer = layer_of(paged)
    assert paged.gate_up_proj.shape[0] == k
    for step in range(STEPS):
        pool = pool_for_waves(rng, E, k, TOP_K, tokens, waves)
        ids, ref_ids, distinct = draw_routing(rng, tokens, TOP_K, E, pool, pad_frac=0.3 if pad else 0.0)
        x, w = random_inputs(tokens, H, TOP_K, DTYPES[dtype], gen)
        before = copy.copy(moepage.stats(paged)[layer.name])
        out = paged(x, ids, w)
        want = ref(x, ref_ids, w)
        assert out.dtype == want.dtype and out.shape == want.shape
        assert torch.equal(out, want), f"step {step}: max diff {(out.float() - want.float()).abs().max()}"
        after = moepage.stats(paged)[layer.name]
        n_waves = after.waves - before.waves
        assert n_waves == expected_waves(len(distinct), k)
        assert {"one": n_waves == 1, "two": n_waves == 2, "many": n_waves > 2}[waves]
        assert after.steps == before.steps + 1
        assert (after.hits - before.hits) + (after.misses - before.misses) == len(distinct)
        if k == E:
            assert after.misses == 0
    if waves != "one":
        assert moepage.stats(paged)[layer.name].misses > 0
    layer.check_slots()


@pytest.mark.parametrize("impl,pad", [("eager", False), ("eager", True), ("grouped_mm", False)])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("top_k,k", [(1, 1), (1, 3), (3, 5), (4, 4), (4, 7)])
def test_other_top_k(impl, pad, dtype, top_k, k):
    """top_k = 1, 3, 4 (with top_k >= 3 the order of the per-token sum matters), including
    K = top_k = 1 (one slot: a step of n experts is n waves)."""
    rng = random.Random(top_k * 100 + k)
    gen = torch.Generator().manual_seed(k)
    paged, ref = make_experts(12, 24, 8, top_k, impl, DTYPES[dtype], seed=k)
    moepage.wrap(paged, resident=k, backend="mock")
    for _ in range(6):
        tokens = rng.choice([1, 5, 40])
        pool = rng.sample(range(12), rng.randint(top_k, min(12, tokens * top_k)))
        ids, ref_ids, _ = draw_routing(rng, tokens, top_k, 12, pool, pad_frac=0.25 if pad else 0.0)
        x, w = random_inputs(tokens, 24, top_k, DTYPES[dtype], gen)
        assert torch.equal(paged(x, ids, w), ref(x, ref_ids, w))


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_bf16_hidden_fp32_weights(impl):
    """Router weights in fp32 with bf16 hidden states (the weighted sum promotes): still exact."""
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    paged, ref = make_experts(E, H, I, TOP_K, impl, torch.bfloat16, seed=7)
    moepage.wrap(paged, resident=5, backend="torch")
    for waves in ("one", "two", "many", "many", "one"):
        ids, ref_ids, _ = draw_routing(rng, 33, TOP_K, E, pool_for_waves(rng, E, 5, TOP_K, 33, waves))
        x = torch.randn(33, H, generator=gen).to(torch.bfloat16)
        w = torch.rand(33, TOP_K, generator=gen).softmax(-1)
        assert torch.equal(paged(x, ids, w), ref(x, ref_ids, w))


def test_all_padding_and_empty_steps():
    """A step whose entries are all padding pages nothing and returns the reference's zeros; a
    step of zero tokens returns an empty tensor."""
    paged, ref = make_experts(E, H, I, TOP_K, "eager", torch.float32, seed=3)
    moepage.wrap(paged, resident=4, backend="mock")
    store = layer_of(paged).store
    x, w = random_inputs(5, H, TOP_K, torch.float32)
    ids = torch.tensor([[-1, E], [E + 3, -2], [E, E + 1], [-1, -1], [E, -7]])
    out = paged(x, ids, w)
    assert torch.equal(out, ref(x, torch.full_like(ids, E), w))
    assert store.log == []
    empty = paged(x[:0], ids[:0], w[:0])
    assert empty.shape == (0, H)
    assert moepage.stats(paged)[layer_of(paged).name].waves == 0


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_toy_moe_model(impl, dtype):
    """The whole model: logits and greedy generation, K < E, with misses."""
    torch.manual_seed(11)
    model = ToyMoE(vocab=96, hidden=32, inter=32, layers=3, num_experts=8, top_k=2, implementation=impl)
    model = model.to(DTYPES[dtype]).eval()
    ref = copy.deepcopy(model)
    moepage.wrap(model, resident=3, backend="mock")
    st = moepage.stats(model)
    assert sorted(st) == [f"blocks.{i}.experts" for i in range(3)]
    for n in (1, 9, 70):
        ids = torch.randint(0, 96, (n,))
        with torch.no_grad():
            assert torch.equal(model(ids), ref(ids))
        assert torch.equal(model.generate(ids, 6), ref.generate(ids, 6))
    st = moepage.stats(model)
    assert all(s.misses > 0 and s.steps > 0 for s in st.values())
    assert st.total.waves > st.total.steps  # some steps needed several waves


@pytest.mark.parametrize("backend", ["torch", "mock", "mock-instance"])
def test_backends_agree(backend):
    torch.manual_seed(5)
    model = ToyMoE(vocab=64, hidden=32, inter=16, layers=2, num_experts=8, top_k=2).eval()
    ref = copy.deepcopy(model)
    store = MockStore() if backend == "mock-instance" else backend
    moepage.wrap(model, resident=2, backend=store)
    if backend == "mock-instance":
        assert all(layer.store is store for layer in moepage.paged_layers(model))
    ids = torch.randint(0, 64, (48,))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(ids), ref(ids))
            ids = torch.randint(0, 64, (48,))
    assert torch.equal(model.generate(ids[:5], 5), ref.generate(ids[:5], 5))
    assert moepage.stats(model).total.misses > 0


@pytest.mark.parametrize("slots", [5, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_prefill_overlap_is_exact_and_never_pages_into_the_running_wave(implementation, dtype, slots, monkeypatch):
    """With prefill_overlap, wave i+1 is paged in before wave i runs: its loads must never target
    a slot of wave i, and the output stays the unpaged layer's."""
    from moepage.backends.mock import MockStore
    from moepage.toy import ToyExperts

    torch.manual_seed(11)
    e, k = 16, 4
    ref = ToyExperts(e, 32, 64, k, implementation).to(dtype)
    paged = copy.deepcopy(ref)
    store = MockStore()
    moepage.wrap(paged, resident=slots, backend=store, prefill_overlap=True, verify=True)
    layer = next(moepage.paged_layers(paged))
    steps: list[list] = []  # per host-planned step: [wave, entries paged in before it ran]
    from moepage import step as step_module

    place, waves_of = step_module._place_waves, layer.waves

    def placed(pager, distinct, size):  # the step's waves, as placed
        waves = place(pager, distinct, size)
        steps.append([[w, None] for w in waves])
        return waves

    def spying(*args):  # each wave's count of entries paged in when it starts running
        runner, start = waves_of(*args), len(store.log)
        run = runner.run

        def record(wave):
            if steps and wave.count == len(steps[-1]):
                steps[-1][wave.index][1] = len(store.log) - start
            run(wave)

        runner.run = record
        return runner

    monkeypatch.setattr(step_module, "_place_waves", placed)
    layer.waves = spying
    paged_per_step = []  # entries the store paged in during each step
    for t in (1, 7, 64, 5, 33):
        x = torch.randn(t, 32, dtype=dtype)
        idx = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
        w = torch.rand(t, k, dtype=dtype)
        before = len(store.log)
        assert torch.equal(paged(x, idx, w), ref(x, idx, w))
        paged_per_step.append(len(store.log) - before)
    assert sum(len(waves) > 2 for waves in steps) >= 3  # several multi-wave steps
    for seen in steps:
        waves = [wave for wave, _ in seen]
        for i, (wave, logged) in enumerate(seen[:-1]):
            nxt = waves[i + 1]
            assert len(wave.experts) <= slots // 2
            # wave ``nxt`` is paged in before ``wave`` runs (to overlap it): never into its slots
            assert logged == sum(len(w.loads) for w in waves[: i + 2])
            assert not set(wave.slots) & {s for _, s in nxt.loads}
    # every planned load is paged in exactly once: the last wave is not paged again
    assert paged_per_step == [sum(len(w.loads) for w, _ in seen) for seen in steps]
    assert sum(paged_per_step) == moepage.stats(paged).total.misses


@pytest.mark.parametrize("slots", [5, 6])
def test_prefill_overlap_failed_page_in_leaves_the_next_step_exact(slots):
    from moepage.backends.mock import MockStore
    from moepage.toy import ToyExperts

    torch.manual_seed(12)
    e, k = 16, 4
    for fail in (1, 5, 9, 14):
        ref = ToyExperts(e, 32, 64, k)
        paged = copy.deepcopy(ref)
        moepage.wrap(paged, resident=slots, backend=MockStore(fail_at={fail}), prefill_overlap=True)
        layer = next(moepage.paged_layers(paged))
        x, w = torch.randn(40, 32), torch.rand(40, k)
        idx = torch.stack([torch.randperm(e)[:k] for _ in range(40)])
        with pytest.raises(moepage.PageInError):
            paged(x, idx, w)
        layer.check_slots()  # every slot the residency trusts holds its expert's rows
        assert torch.equal(paged(x, idx, w), ref(x, idx, w))


class PositionalExperts(ToyExperts):
    """``grouped_mm``-style experts whose output for a row depends on the row's place among its
    expert's rows, as a CPU GEMM's M-tail kernels can (there by ~1 ulp, here visibly)."""

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        place = torch.arange(x.shape[0], dtype=x.dtype)[:, None]
        return super()._expert(x, e) + place * 1e-3


@pytest.mark.parametrize("waves", ["one", "many"])
def test_tie_order_of_a_sort_grouped_implementation_is_reproduced(waves):
    """An implementation that groups entries with an unstable ``torch.sort`` (CPU: ``std::sort``
    beyond 16 entries) visits one expert's rows in an order set by the whole id array; per entry,
    the rows are arranged so that its sort of slot ids reproduces that order (``runners.
    order_for_sort``). A row's output depends on its place here, so any other order differs."""
    e, top_k, k = 16, 2, 6
    torch.manual_seed(8)
    ref = PositionalExperts(e, 16, 8, top_k, "grouped_mm")
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=k, backend="mock")
    rng, gen = random.Random(9), torch.Generator().manual_seed(9)
    for _ in range(4):  # slots soon hold experts in an order unlike their ids
        pool = rng.sample(range(e), k) if waves == "one" else list(range(e))
        ids, ref_ids, _ = draw_routing(rng, 40, top_k, e, pool)  # 80 entries: std::sort's unstable range
        x, w = random_inputs(40, 16, top_k, torch.float32, gen)
        assert torch.equal(paged(x, ids, w), ref(x, ref_ids, w))
    assert moepage.stats(paged).total.waves == (4 if waves == "one" else 12)


def test_order_for_sort_groups_by_slot_in_rank_order():
    from moepage.contract import order_for_sort

    g = torch.Generator().manual_seed(10)
    for n in (5, 17, 80, 300):
        slots = torch.randint(0, 6, (n,), generator=g)
        rank = torch.randperm(n, generator=g)
        order = order_for_sort(slots, rank, n)
        assert sorted(order.tolist()) == list(range(n))  # a permutation of the rows
        visited = order[torch.sort(slots[order])[1]]  # the rows in the order a sort-grouped run visits them
        assert torch.equal(slots[visited], torch.sort(slots).values)
        for s in range(6):
            ranks = rank[visited][slots[visited] == s]
            assert torch.equal(ranks, torch.sort(ranks).values)
