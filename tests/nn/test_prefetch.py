"""Next-layer expert prefetch (issue 15, ``moepage.prefetch``).

- Exactness: the committed tiny trained Qwen3-MoE and the toy model, paged with prefetch on, equal
  the unpaged model (``torch.equal``), fp32 and bf16, K = top_k, between and E, steps of one, two
  and many waves, on the device planner (CPU torch planner; also inside ``capture_mode``, the path
  a capture takes) and on the host planner.
- One state: device-planned steps, host-planned steps and prefetches (issued by steps and called
  directly) in random order, each step exact, every slot equal to its host row, and each layer's
  residency equal to a host-only replay of the same placements, prefetch waves included.
- Where it is issued: after the step's first page-in, before its first wave computes.
- Effect: on held-out text, decode-like steps at K/E = 0.25 page fewer experts on the critical
  path with prefetch than without.
- Failures, configuration errors, unwrap, the Triton planner under the interpreter, and (GPU) a
  captured multi-layer decode step replayed between eager prefill steps.
"""

from __future__ import annotations

import copy

import pytest
import torch

import moepage
from helpers.flows import decode_equal
from helpers.models import device_forward
from helpers.reference import check_residency
from helpers.routing import random_inputs
from helpers.tiny import CKPT, text_tokens
from moepage.backends.mock import MockStore
from moepage.residency import Residency
from moepage.toy import ToyExperts, ToyMoE

gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuda backend, CUDA graphs)"),
]
PLANNERS = {  # wrap's device_planner, and whether every step runs inside capture_mode
    "device": (True, False),
    "capture": (True, True),
    "host": (False, False),
}

pytestmark = pytest.mark.usefixtures("single_thread")


def _replay_prefetch(res: Residency, ids: torch.Tensor) -> int:
    """The prefetch rule, written out: the distinct valid ids as wave 0 of a step routing them
    (resident ones first, then missing ones, each ascending), at most K. Returns the loads."""
    distinct = sorted({i for i in ids.flatten().tolist() if 0 <= i < res.num_experts})
    first = [e for e in distinct if res.is_resident(e)] + [e for e in distinct if not res.is_resident(e)]
    return len(res.place(first[: res.num_slots]).loads)


def _run_planner(planner: str):
    return moepage.capture_mode() if PLANNERS[planner][1] else moepage.capture_mode(False)


# -- exactness: the toy model --------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("planner", list(PLANNERS))
def test_toy_with_prefetch_equals_unpaged(impl, dtype, planner):
    e, top_k = 16, 2
    torch.manual_seed(0)
    ref = ToyMoE(vocab=64, hidden=32, inter=16, layers=3, num_experts=e, top_k=top_k, implementation=impl).to(dtype)
    prompt = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(1))
    want = ref.generate(prompt, 6)
    want_logits = ref(want)
    for k in (top_k, 7, e):  # 12+ tokens x top-2 route up to 16 experts: one, two or three waves
        for prefetch in (True, 2 * top_k):
            paged = copy.deepcopy(ref)
            moepage.wrap(paged, resident=k, backend="torch", device_planner=PLANNERS[planner][0], prefetch=prefetch)
            with _run_planner(planner):
                assert torch.equal(paged.generate(prompt, 6), want)  # the prefix grows: 1 to many waves
                assert torch.equal(paged(want), want_logits)
                for t in range(3):  # single-token steps: one wave
                    assert torch.equal(paged(want[t : t + 1]), ref(want[t : t + 1]))
            total = moepage.stats(paged).total
            assert total.prefetched > 0 or k == e, (k, prefetch)
            assert total.bytes_paged \
                == (total.misses + total.prefetched) * next(moepage.paged_layers(paged)).pager.row_bytes
            for layer in moepage.paged_layers(paged):
                check_residency(layer.read_residency())
                layer.check_slots()


# -- exactness: the tiny trained Qwen3-MoE -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    """``tiny(dtype) -> (reference model, prompt, its logits)``, built once per dtype."""
    import safetensors  # noqa: F401  (the [test] extra installs it)
    import transformers  # noqa: F401  (the [test] extra installs it)
    from transformers import AutoModelForCausalLM

    text = text_tokens(40)
    made = {}

    def get(dtype):
        if dtype not in made:
            ref = AutoModelForCausalLM.from_pretrained(CKPT, dtype=dtype).eval()
            for p in ref.parameters():  # owned, aligned storage as moepage's loader gives
                p.data = p.data.clone()
            made[dtype] = (ref, text, _decode(ref, text))
        return made[dtype]

    return get


def _decode(model, text: torch.Tensor, prefill: int = 24) -> list[torch.Tensor]:
    """Logits of a prefill of ``prefill`` tokens, then of one-token steps over the rest of ``text``
    (teacher-forced, with a KV cache: decode-like steps on real text)."""
    from transformers import DynamicCache

    with torch.no_grad():
        out = model(text[:, :prefill], past_key_values=DynamicCache(config=model.config), use_cache=True)
        logits = [out.logits]
        for t in range(prefill, text.shape[1]):
            out = model(text[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits)
    return logits


def _paged_tiny(dtype, k: int, **kwargs):
    from moepage.integrations import transformers as mhf

    return mhf.from_pretrained(str(CKPT), resident=k, device="cpu", dtype=dtype, progress=False, backend="torch",
                               **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("planner", list(PLANNERS))
def test_tiny_moe_with_prefetch_equals_unpaged(tiny, dtype, planner):
    ref, text, want = tiny(dtype)
    top_k = ref.config.num_experts_per_tok
    for k in (top_k, 16, 32):  # K = top_k, between, E (32): a 24-token prefill takes many, two, one waves
        for prefetch in (True, 2 * top_k):
            paged = _paged_tiny(dtype, k, device_planner=PLANNERS[planner][0], prefetch=prefetch)
            with _run_planner(planner):
                got = _decode(paged, text)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (k, prefetch)
            total = moepage.stats(paged).total
            assert total.prefetched > 0 or k == 32
            assert (total.waves > total.steps) == (k < 32)
            for layer in moepage.paged_layers(paged):
                layer.check_slots()


def test_tiny_moe_prefetch_pages_fewer_experts_on_the_critical_path():
    """Decode-like steps over held-out text at K/E = 0.25: the routers of the next layers predict
    well (tests/test_tiny_moe.py), so the steps' own misses drop and prefetches do page."""
    import transformers  # noqa: F401  (the [test] extra installs it)
    text = text_tokens(96)
    for device_planner in (True, False):
        runs = {}
        for prefetch in (False, True):
            paged = _paged_tiny(torch.float32, 8, device_planner=device_planner, prefetch=prefetch)
            logits = _decode(paged, text, prefill=16)
            runs[prefetch] = (logits, moepage.stats(paged).total)
        (plain, off), (fetched, on) = runs[False], runs[True]
        assert all(torch.equal(a, b) for a, b in zip(plain, fetched))
        assert off.prefetched == 0 and on.prefetched > 0
        assert on.steps == off.steps
        # Measured: 566 -> 407 misses (367 prefetched) on this text.
        assert on.misses < 0.85 * off.misses, (on.misses, off.misses, on.prefetched)


# -- where a step issues the prefetch ----------------------------------------------------------------
@pytest.mark.parametrize("device_planner", [True, False])
def test_prefetch_is_issued_after_the_first_page_in_and_before_the_first_compute(device_planner, monkeypatch):
    torch.manual_seed(3)
    ref = ToyMoE(vocab=32, hidden=16, inter=8, layers=2, num_experts=8, top_k=2)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=3, backend="torch", device_planner=device_planner, prefetch=True)
    first, second = moepage.paged_layers(paged)
    with moepage.capture_mode(device_planner):
        paged(torch.tensor([1]))  # the first step checks the implementation, calling the forward itself
    events: list[tuple] = []

    def spy(owner, attr, event):
        real = getattr(owner, attr)
        monkeypatch.setattr(owner, attr, lambda *a, **kw: (events.append(event(*a, **kw)), real(*a, **kw))[1])

    if device_planner:  # every page-in, of a step or a prefetch, is one gather
        spy(first.store, "gather", lambda layer, *a, **kw: ("page_in", layer, kw.get("background", False)))
    else:  # every wave's page-in, also of nothing
        for layer in (first, second):
            spy(layer.pager, "page_in", lambda loads, prefetch=False, name=layer.name: ("page_in", name, prefetch))
    spy(moepage.prefetch, "prefetch", lambda pager, ids: ("prefetch",))
    spy(first, "original_forward", lambda *a: ("compute",))
    tokens = torch.tensor([3, 9, 17, 30])  # 8 entries > K = 3: several waves
    for ids in (tokens[:1], tokens):
        events.clear()
        with moepage.capture_mode(device_planner):  # the device planner takes every step
            assert torch.equal(paged(ids), ref(ids))
        at = events.index(("prefetch",))
        assert events[at - 1] == ("page_in", first.name, False)  # after the step's first page-in ...
        assert events[at + 1] == ("page_in", second.name, True)  # (the prefetch's own, in the background)
        assert events[at + 2] == ("compute",)  # ... and before its first wave computes
        assert ("compute",) not in events[:at] and events.count(("prefetch",)) == 1


# -- every reader awaits a pending prefetch ---------------------------------------------------------
class FakeStream:
    """Stands in for the current CUDA stream on the CPU: records the events it is told to wait for."""

    def __init__(self):
        self.waited: list[object] = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


@pytest.mark.parametrize("reader", ["device_step", "host_step", "check_slots", "residency", "load_state_dict",
                                    "prefetch", "unwrap"])
def test_every_reader_of_a_layer_awaits_its_pending_prefetch(reader, monkeypatch):
    """On CUDA a prefetch's page-in runs on a side stream and stays pending: whatever reads the
    layer's slots or state next makes the current stream wait for it first (on the CPU nothing is
    ever pending, so here a stand-in event is)."""
    torch.manual_seed(11)
    ref = ToyMoE(vocab=32, hidden=16, inter=8, layers=2, num_experts=8, top_k=2)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=3, backend="torch", device_planner=True, prefetch=True)
    second = list(moepage.paged_layers(paged))[1]
    stream = FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    pending = object()
    second.pager._pending = (pending, False)
    x, w = random_inputs(4, 16, 2, torch.float32, torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 5], [6, 7], [1, 2], [3, 4]])
    experts = paged.blocks[1].experts
    if reader == "device_step":
        device_forward(second, x[:1], ids[:1], w[:1])
    elif reader == "host_step":
        second.forward(x, ids, w)
    elif reader == "check_slots":
        second.check_slots()
    elif reader == "residency":
        second.read_residency()
    elif reader == "load_state_dict":
        experts.load_state_dict(ref.blocks[1].experts.state_dict())
    elif reader == "prefetch":
        moepage.prefetch.prefetch(second.pager, ids)
    else:
        moepage.unwrap(paged)
    assert stream.waited[:1] == [pending] and second.pager._pending is None


def test_an_event_from_before_a_capture_is_not_waited_for_inside_it(monkeypatch):
    """A capture cannot wait for an event recorded outside it; torch.cuda.graph synchronises the
    device when it begins, so such a page-in has completed and is dropped."""
    from moepage import capture as pager_module

    torch.manual_seed(12)
    model = ToyMoE(vocab=32, hidden=16, inter=8, layers=2, num_experts=8, top_k=2)
    moepage.wrap(model, resident=3, backend="torch", device_planner=True, prefetch=True)
    pager = list(moepage.paged_layers(model))[1].pager
    stream = FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(pager_module, "capturing", lambda: True)
    for captured in (False, True):
        pager._pending = ("event", captured)
        pager.await_prefetch()
        assert pager._pending is None
    assert stream.waited == ["event"]  # only the one recorded inside the capture


# -- failures ---------------------------------------------------------------------------------------
MISSING = {"blocks.1.experts": lambda h: torch.tensor([[12, 13, 14, 15]])}  # none resident at start: 4 loads


def test_failed_device_prefetch_forgets_its_slots(monkeypatch):
    torch.manual_seed(9)
    ref = ToyMoE(vocab=32, hidden=16, inter=8, layers=2, num_experts=16, top_k=2)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=4, backend="torch", device_planner=True, prefetch=MISSING)
    first, second = moepage.paged_layers(paged)
    store = first.store
    real = store.gather

    def failing(layer, *args, background=False):
        if background:
            raise RuntimeError("link down")
        return real(layer, *args)

    monkeypatch.setattr(store, "gather", failing)
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    with pytest.raises(moepage.PageInError, match="device prefetch of 4 experts failed: link down"):
        paged(ids[:1])
    assert second.read_residency().slot_expert == [-1] * 4  # planned, never paged: forgotten
    assert second.read_stats().misses == 0
    monkeypatch.setattr(store, "gather", real)
    second.check_slots()
    for _ in range(3):
        assert torch.equal(paged(ids[:1]), ref(ids[:1]))
        assert torch.equal(paged(ids), ref(ids))
    for layer in (first, second):
        layer.check_slots()


def test_failed_host_prefetch_forgets_its_slots():
    torch.manual_seed(10)
    ref = ToyMoE(vocab=32, hidden=16, inter=8, layers=2, num_experts=16, top_k=2)
    paged = copy.deepcopy(ref)
    store = MockStore()
    moepage.wrap(paged, resident=4, backend=store, prefetch=MISSING)
    first, second = moepage.paged_layers(paged)
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    store.fail_at = {1}  # the first row copy tears: the prefetch's, as the step's experts are resident
    with pytest.raises(moepage.PageInError, match="mock failure"):
        first.module_ref(torch.zeros(1, 16), torch.tensor([[0, 1]]), torch.full((1, 2), 0.5))
    # forgotten, not counted
    assert second.read_residency().slot_expert == [-1] * 4 and second.read_stats().prefetched == 0
    second.check_slots()
    for _ in range(3):
        assert torch.equal(paged(ids), ref(ids))
    for layer in (first, second):
        layer.check_slots()


# -- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -1, 1.5, "yes", [2], 17])
def test_bad_prefetch_is_refused_before_anything_is_allocated(value):
    model = ToyMoE(vocab=16, hidden=16, inter=8, layers=2, num_experts=16, top_k=2)
    store = MockStore()
    with pytest.raises(moepage.ConfigError, match="prefetch") as err:
        moepage.wrap(model, resident=4, backend=store, prefetch=value)
    if value == 17:
        assert "blocks.1.experts" in str(err.value) and "E=16" in str(err.value)
    assert store.host_bytes() == 0 and not list(moepage.paged_layers(model))


class TwoExperts(torch.nn.Module):
    """Two experts modules side by side, no router: prefetch needs a predictor mapping."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.a, self.b = ToyExperts(8, 16, 8, 2), ToyExperts(8, 16, 8, 2)


def test_prefetch_without_a_router_needs_a_predictor_mapping():
    model = TwoExperts()
    with pytest.raises(moepage.ConfigError, match=r"layer b: prefetch needs this layer's router.*prefetch=\{'b'"):
        moepage.wrap(model, resident=3, backend="torch", prefetch=True)
    for bad, match in (({"a": lambda h: h}, r"keys \['a'\]"), ({"c": lambda h: h}, r"keys \['c'\]"),
                       ({"b": 3}, "not callables")):
        with pytest.raises(moepage.ConfigError, match=match):
            moepage.wrap(model, resident=3, backend="torch", prefetch=bad)
    assert not list(moepage.paged_layers(model))

    ref = copy.deepcopy(model)
    seen = []

    def predictor(hidden):
        seen.append(hidden.shape)
        return torch.tensor([[5, 6, 7]]).expand(hidden.shape[0], 3)

    moepage.wrap(model, resident=3, backend="torch", prefetch={"b": predictor})
    x, w = random_inputs(2, 16, 2, torch.float32, torch.Generator().manual_seed(0))
    assert torch.equal(model.a(x, torch.tensor([[0, 1], [1, 2]]), w), ref.a(x, torch.tensor([[0, 1], [1, 2]]), w))
    assert seen == [(2, 16)]
    b = moepage.stats(model)["b"]
    assert b.prefetched == 3 and sorted(model.b._moepage.read_residency().slot_expert) == [5, 6, 7]
    assert torch.equal(model.b(x, torch.tensor([[5, 6], [7, 5]]), w), ref.b(x, torch.tensor([[5, 6], [7, 5]]), w))
    assert moepage.stats(model)["b"].misses == 0  # every routed expert was prefetched


def test_unwrap_removes_prefetch():
    torch.manual_seed(5)
    ref = ToyMoE(vocab=32, hidden=16, inter=8, layers=3, num_experts=8, top_k=2)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=3, backend="torch", device_planner=True, prefetch=True)
    ids = torch.tensor([1, 5, 9])
    assert torch.equal(paged(ids), ref(ids))
    moepage.unwrap(paged.blocks[2])  # one layer alone: the one before it stops prefetching into it
    assert torch.equal(paged(ids), ref(ids))
    assert len(list(moepage.paged_layers(paged))) == 2 and "blocks.2.experts" not in moepage.stats(paged)
    moepage.unwrap(paged)
    assert not list(moepage.paged_layers(paged))
    assert all(torch.equal(a, b) for a, b in zip(paged.state_dict().values(), ref.state_dict().values()))
    assert torch.equal(paged(ids), ref(ids))


# -- the Triton planner, under the interpreter ------------------------------------------------------
def test_triton_planner_with_prefetch(monkeypatch):
    from moepage import pager as device_residency
    from moepage.kernels.planner import plan_step_triton, triton_available

    if not triton_available():
        pytest.skip("needs triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(device_residency, "plan_step", plan_step_triton)  # steps and prefetches alike
    torch.manual_seed(6)
    ref = ToyMoE(vocab=32, hidden=16, inter=8, layers=2, num_experts=8, top_k=2)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=3, backend="torch", device_planner=True, prefetch=4, policy="lfu:3")
    host = copy.deepcopy(ref)
    moepage.wrap(host, resident=3, backend="torch", device_planner=False, prefetch=4, policy="lfu:3")
    for ids in ([1], [4], [1, 7, 20], [9], [2, 3]):  # one-token steps: 2 entries, prefetches of 4 > K = 3
        ids = torch.tensor(ids)
        with moepage.capture_mode():
            assert torch.equal(paged(ids), ref(ids))
        assert torch.equal(host(ids), ref(ids))
        for a, b in zip(moepage.paged_layers(paged), moepage.paged_layers(host)):
            assert a.read_residency().table() == b.read_residency().table()
            a.check_slots()
    assert moepage.stats(paged).total.prefetched == moepage.stats(host).total.prefetched > 0


# -- GPU: captured decode with prefetch ------------------------------------------------------------


def test_static_cache_decode_with_prefetch_on_cpu():
    paged = decode_equal("cpu", torch.float32, graph=False, backend="torch", device_planner=True, prefetch=True)
    assert moepage.stats(paged).total.prefetched > 0


def test_router_predictor():
    torch.manual_seed(13)
    weight, bias, hidden = torch.randn(8, 16), torch.randn(8), torch.randn(5, 16).to(torch.bfloat16)
    predict = moepage.RouterPredictor(weight, 3, bias)
    assert torch.equal(predict(hidden), torch.topk(hidden.float() @ weight.T + bias, 3, dim=-1).indices)
    assert predict(hidden).shape == (5, 3)
    for bad_weight, top in ((torch.randn(8), 2), (weight, 0), (weight, 9)):
        with pytest.raises(moepage.ConfigError, match="RouterPredictor"):
            moepage.RouterPredictor(bad_weight, top)
