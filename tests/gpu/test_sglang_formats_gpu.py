"""Every expert format SGLang 0.5.23 describes, on the GPU, on real ``FusedMoE`` layers: served
exactly, or refused at startup with the reason (``helpers.sglang_formats.CASES``, one per format).

Served formats compare paged with unpaged over steps of 1, 2 and many waves, at K = top_k, a K in
between and K = E, on fresh random inputs, and run a captured two-wave decode step, replayed between
eager host-planned steps. The Triton runner is compared bit for bit. The Marlin runner is compared
against its own batch-to-batch noise: the largest difference between unpaged runs of the same tokens
in batches of other shapes (SGLang's documentation says Marlin is not batch invariant); a paged step
must stay within it.
"""

from __future__ import annotations

import random

import pytest
import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)
import torch

from helpers import sglang as H  # noqa: E402
from helpers.sglang_formats import CASES, ENGINE, HIDDEN, MARLIN_FORMATS, SMALL, TOP_K, E, Shape, forward, pair  # noqa: E402
from moepage.errors import ConfigError  # noqa: E402
from moepage.integrations.sglang import checks, compat  # noqa: E402

STEPS = [(1, 2), (2, 3), (5, 6), (9, 8), (3, 5), (16, 8), (4, 4), (32, 8)]  # (tokens, distinct experts)


@pytest.fixture(scope="module", autouse=True)
def sglang_process():
    H.setup_sglang()


needs_kernels = pytest.mark.skipif(not (torch.cuda.is_available() and H.has_sgl_kernel()),
                                   reason="needs a CUDA GPU and sgl_kernel (SGLang's CUDA MoE kernels)")


def topk_of(ids: torch.Tensor, seed: int, e: int = E):
    """A routing as SGLang's TopK gives it (``helpers.sglang.topk_output``: Marlin checks the logits' shape), on the
    GPU."""
    t = H.topk_output(ids, seed, e)
    return t._replace(topk_weights=t.topk_weights.cuda(), topk_ids=t.topk_ids.cuda(),
                      router_logits=t.router_logits.cuda())


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def crowded(experts: int, top_k: int) -> int:
    """How many experts the other tokens of a crowded batch reach: an eighth of them (at least top_k), as a paged wave
    crowds slot 0 with the other waves' entries."""
    return max(top_k, experts // 8)


def marlin_noise(ref, x, topk) -> float:
    """The largest difference between this batch's unpaged outputs and those of the same tokens in batches of other
    shapes: one at a time, in halves, among as many and three times as many other tokens (twice, and once crowding
    few experts), and the same batch run again. Marlin picks its block size from tokens x top_k / experts, so a layer
    paged onto K = E / 4 slots runs the configuration of an unpaged batch four times as large, and each wave crowds
    slot 0 with the other waves' entries: the crowded batch is the closest to a paged step. On Hopper its GEMMs
    reduce with atomic adds (``fused_marlin_moe``, but for MXFP4), so even one batch differs from run to run."""
    whole = forward(ref, x, topk)
    worst = largest_difference(forward(ref, x, topk), whole)
    t = x.shape[0]
    for parts in ([slice(i, i + 1) for i in range(t)], [slice(0, t // 2), slice(t // 2, t)]):
        for part in parts:
            if part.start == part.stop:
                continue
            sub = topk._replace(topk_weights=topk.topk_weights[part], topk_ids=topk.topk_ids[part],
                                router_logits=topk.router_logits[part])
            worst = max(worst, largest_difference(forward(ref, x[part], sub), whole[part]))
    e, k = topk.router_logits.shape[-1], topk.topk_ids.shape[-1]
    for draw, (times, reach) in enumerate([(2, None), (4, None), (4, None), (4, crowded(e, k))]):  # drawn afresh
        worst = max(worst, largest_difference(among_other_tokens(ref, x, topk, (times - 1) * t, reach, draw), whole))
    return worst


def among_other_tokens(ref, x, topk, extra: int, distinct: int | None = None, draw: int = 0) -> torch.Tensor:
    """The unpaged outputs of ``x``'s tokens in one batch with ``extra`` other random tokens after them, routed over
    ``distinct`` experts (by default as many as they can reach); ``draw`` picks their routing."""
    e, k = topk.router_logits.shape[-1], topk.topk_ids.shape[-1]
    distinct = min(e, extra * k) if distinct is None else distinct
    seed = extra + 1000 * (distinct + 1000 * draw)
    more = topk_of(H.routing(random.Random(seed), extra, distinct, top_k=k, e=e), seed, e)
    both = topk._replace(**{f: torch.cat([getattr(topk, f), getattr(more, f).to(getattr(topk, f).dtype)])
                            for f in ("topk_weights", "topk_ids", "router_logits")})
    others = torch.randn(extra, x.shape[1], dtype=x.dtype, device=x.device)
    return forward(ref, torch.cat([x, others]), both)[: x.shape[0]]


def compare(ref, paged, seed: int, dtype: torch.dtype, strict: bool = True, shape: Shape = SMALL,
            steps=STEPS) -> list[tuple[float, float]]:
    """Every step of ``steps`` (tokens, distinct experts) on fresh inputs; for Marlin, each step's (paged - unpaged,
    batch noise). A step beyond what the runner allows fails at once, or, not ``strict``, after every step has been
    measured (the report says all of them)."""
    marlin = compat.contract_for(paged.quant_method.moe_runner) is compat.MARLIN  # the runner's, whatever runs waves
    rng, found, beyond = random.Random(seed), [], []
    for i, (tokens, distinct) in enumerate(steps):
        ids = H.routing(rng, tokens, distinct, top_k=shape.top_k, e=shape.experts)
        topk = topk_of(ids, seed * 100 + i, shape.experts)
        x = torch.randn(tokens, shape.hidden, dtype=dtype, device="cuda")
        got, want = forward(paged, x, topk), forward(ref, x, topk)
        assert torch.isfinite(want).all(), "the random experts overflow: the test data is wrong"
        if marlin:
            diff, noise = largest_difference(got, want), marlin_noise(ref, x, topk)
            found.append((diff, noise))
            ok, what = diff <= noise, f"paged differs by {diff}, beyond Marlin's batch noise {noise}"
        else:
            ok, what = torch.equal(got, want), "paged differs from unpaged"
        if not ok:
            beyond.append(f"step {i} ({tokens} tokens, {distinct} experts): {what}")
            assert not strict, beyond[-1]
    assert not beyond, "; ".join(beyond) + (f"; every step's (diff, noise): {found}" if found else "")
    return found


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_format_served_exactly_or_refused(name):
    case = CASES[name]
    if not case.served:
        with pytest.raises(ConfigError, match="not served by moepage|moepage serves"):
            pair(case, k=3)
        return
    for k in (TOP_K, 3, E):
        ref, paged = pair(case, k, seed=k)
        assert_host_rows_are_the_format(ref, paged)
        compare(ref, paged, seed=k, dtype=case.dtype)
        assert paged.quant_method.pager.read_stats().steps == len(STEPS)


def assert_host_rows_are_the_format(ref, paged) -> None:
    """The host store holds exactly the unpaged layer's per-expert tensors after its post-load step:
    same shapes, dtypes and bytes (no padding, no dequantized copy), whatever the format; and each of
    the K slots the GPU holds is one such row, the layer's tensor pointing at them."""
    method = paged.quant_method
    for name in method.pager.specs:
        host, unpaged = method.store.host_rows(method.layer_key, name), getattr(ref, name).data
        assert host.shape == unpaged.shape and host.dtype == unpaged.dtype, name
        assert torch.equal(host, unpaged.cpu()), name
        slots = method.store.slots(method.layer_key, name)
        assert slots.shape == (method.num_slots, *unpaged.shape[1:]) and slots.dtype == unpaged.dtype, name
        assert getattr(paged, name).data_ptr() == slots.data_ptr(), name


@pytest.mark.gpu
@pytest.mark.measurement
@needs_kernels
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c.served])
def test_gpu_refused_format_would_it_be_exact(name, monkeypatch):
    """What serving a refused format would give: the same comparison with the refusal lifted (the
    measurement that decides whether a format joins ``checks.SERVED``; ``--measurements`` runs it, and
    it fails while the format stays refused)."""
    case = CASES[name]
    monkeypatch.setattr(checks, "SERVED", (*checks.SERVED, case.fmt))
    if case.block is not None:
        monkeypatch.setattr(checks, "FP8_BLOCKS", (*checks.FP8_BLOCKS, list(case.block)))
    if case.bits is not None:
        monkeypatch.setitem(checks.CHECKED_BITS, case.fmt, (*checks.CHECKED_BITS.get(case.fmt, ()), case.bits))
    reports, beyond = [], []
    for k in (TOP_K, 3, E):
        ref, paged = pair(case, k, seed=k)
        try:
            assert_host_rows_are_the_format(ref, paged)  # all that the served test checks, so a pass can serve it
            found = compare(ref, paged, seed=k, dtype=case.dtype, strict=False)
            assert paged.quant_method.pager.read_stats().steps == len(STEPS)
        except AssertionError as exc:
            beyond.append(f"K={k}: {exc}")
            continue
        reports.append(f"{name} K={k}: {type(paged.quant_method.contract).__name__}, per step "
                       f"(max |paged - unpaged|, batch noise): {found}")
    print("\n".join(reports))
    assert not beyond, "\n".join(beyond)


def replay_between_eager_steps(ref, paged, dtype, judge) -> None:
    """A decode step of 2 tokens x top-2 = 4 entries > K = 3 (two device waves), captured as SGLang's runner captures
    it, replayed on fresh routing between eager host-planned steps; ``judge(got, x, topk, what)`` checks each output
    against the unpaged layer's."""
    import moepage.capture as capture

    assert paged.quant_method.pager.device_state is not None
    rng = random.Random(3)
    ids = H.routing(rng, 2, 4, top_k=TOP_K, e=E).cuda()
    x = torch.randn(2, HIDDEN, dtype=dtype, device="cuda")
    topk = topk_of(ids, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), capture.capture_mode():
        judge(forward(paged, x, topk), x, topk, "warm-up")  # a real step
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture.capture_mode(), torch.cuda.graph(graph):
        out = forward(paged, x, topk)
    for i in range(10):
        tokens, distinct = rng.choice([(9, 8), (5, 6), (16, 8)])
        e_ids = H.routing(rng, tokens, distinct, top_k=TOP_K, e=E)
        e_x = torch.randn(tokens, HIDDEN, dtype=dtype, device="cuda")
        e_topk = topk_of(e_ids, 100 + i)
        judge(forward(paged, e_x, e_topk), e_x, e_topk, f"eager {i}")
        for j in range(3):
            new = topk_of(H.routing(rng, 2, rng.randint(2, 4), top_k=TOP_K, e=E), 1000 + 10 * i + j)
            ids.copy_(new.topk_ids)
            topk.topk_weights.copy_(new.topk_weights)
            x.copy_(torch.randn_like(x))
            graph.replay()
            judge(out, x, topk, f"replay {j} after eager {i}")


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_format_captured_decode_between_eager_steps(name):
    """Bit for bit on Triton; on Marlin, every eager step and replay within Marlin's batch noise (each printed)."""
    case = CASES[name]
    if not case.served:
        pytest.skip(f"{case.fmt} is refused (test_gpu_format_served_exactly_or_refused)")
    ref, paged = pair(case, 3, graphs=("full", "disabled"), seed=7)
    marlin = compat.contract_for(paged.quant_method.moe_runner) is compat.MARLIN
    found = []

    def judge(got, x, topk, what):
        want = forward(ref, x, topk)
        if not marlin:
            assert torch.equal(got, want), what
            return
        found.append((largest_difference(got, want), marlin_noise(ref, x, topk)))
        assert found[-1][0] <= found[-1][1], f"{what}: paged differs by {found[-1][0]}, beyond Marlin's noise; {found}"

    replay_between_eager_steps(ref, paged, case.dtype, judge)
    if marlin:
        print(f"{name} K=3, every eager step and replay (max |paged - unpaged|, batch noise): {found}")


ENGINE_STEPS = [(1, 8), (4, 30), (8, 61), (16, 100), (32, 128), (64, 128)]  # (tokens, distinct experts)


@pytest.mark.gpu
@pytest.mark.measurement
@needs_kernels
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.served and c.fmt in MARLIN_FORMATS])
def test_gpu_marlin_at_the_engine_s_shapes_within_its_noise(name):
    """The Marlin formats at the engine benchmark's shapes (Qwen3-30B-A3B's experts: 128, top-8, hidden 2048,
    intermediate 768) and K = 32: steps of 1 to 64 tokens (1 to 4 waves), each step's (max |paged - unpaged|, Marlin's
    batch noise) printed. Their engine runs matched unpaged tokens as often as the unpaged engine matches itself across
    batch shapes; this says whether a paged step stays within the unpaged layer's own batch noise at those shapes."""
    case = CASES[name]
    ref, paged = pair(case, 32, seed=1, shape=ENGINE)
    found = compare(ref, paged, seed=1, dtype=case.dtype, strict=False, shape=ENGINE, steps=ENGINE_STEPS)
    print(f"{name} at the engine's shapes, K = 32 of 128, per step (max |paged - unpaged|, batch noise): {found}")


RUNS = 16
FOUR_WAVES = ENGINE_STEPS[4]  # 32 tokens over all 128 experts: 4 waves of K = 32
# Batches the same 32 tokens meet in a server: (other tokens, the experts they reach); alone, and among others
_ALL, _CROWDED = ENGINE.experts, crowded(ENGINE.experts, ENGINE.top_k)
OTHER_BATCHES = [(0, 0), (32, _ALL), (96, _ALL), (96, _CROWDED), (224, _ALL), (480, _ALL)]


@pytest.mark.gpu
@pytest.mark.measurement
@needs_kernels
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.served and c.fmt in MARLIN_FORMATS])
def test_gpu_marlin_four_wave_step_against_its_batch_noise(name):
    """On Hopper Marlin reduces with atomic adds (``fused_marlin_moe``, but for MXFP4): one batch differs from run to
    run, and a batch's split of each reduction depends on its shape. At the engine's shapes and K = 32, one step of 32
    tokens over all 128 experts (4 waves): the unpaged layer runs them RUNS times in each batch of OTHER_BATCHES (the
    other tokens drawn afresh each run), the paged layer RUNS times alone; each run's max |output - the first unpaged
    run's| is printed per batch. The paged runs' median must stay within the unpaged runs' largest. (Not their largest:
    the noise is heavy-tailed, and of 16 paged and 96 unpaged draws of one distribution the largest is a paged one one
    time in seven. Measured on an H200: bench/RESULTS.md.)"""
    case = CASES[name]
    ref, paged = pair(case, 32, seed=1, shape=ENGINE)
    tokens, distinct = FOUR_WAVES
    ids = H.routing(random.Random(1), tokens, distinct, top_k=ENGINE.top_k, e=ENGINE.experts)
    topk = topk_of(ids, 100, ENGINE.experts)
    x = torch.randn(tokens, ENGINE.hidden, dtype=case.dtype, device="cuda")
    first = forward(ref, x, topk)

    def unpaged_runs(extra: int, reach: int) -> list[float]:
        return sorted(largest_difference(among_other_tokens(ref, x, topk, extra, reach, draw) if extra
                                         else forward(ref, x, topk), first) for draw in range(RUNS))

    unpaged = {(extra, reach): unpaged_runs(extra, reach) for extra, reach in OTHER_BATCHES}
    paged_runs = sorted(largest_difference(forward(paged, x, topk), first) for _ in range(RUNS))
    noise = max(max(r) for r in unpaged.values())
    print(f"{name}, 32 tokens, 4 waves, {RUNS} runs each, max |run - first unpaged run|: paged {paged_runs}; unpaged "
          + "; ".join(f"among {extra} others over {reach} experts {r}" for (extra, reach), r in unpaged.items()))
    median = paged_runs[RUNS // 2]
    assert median <= noise, f"the paged runs' median {median} is beyond the unpaged runs' largest {noise}"
