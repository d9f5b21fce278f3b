"""``wrap`` / ``unwrap`` / ``stats``: input checks before any allocation, custom parameter names,
verify mode, counters, moved models, and rollback of a failed wrap."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import moepage
from helpers.models import layer_of, make_experts
from helpers.routing import draw_routing, random_inputs
from moepage.backends.mock import MockStore
from moepage.toy import ToyExperts, ToyMoE

pytestmark = pytest.mark.usefixtures("single_thread")

E, H, I, TOP_K = 8, 16, 8, 2


def small_model(layers: int = 2, seed: int = 0, **kw) -> ToyMoE:
    torch.manual_seed(seed)
    return ToyMoE(vocab=48, hidden=H, inter=I, layers=layers, num_experts=E, top_k=TOP_K, **kw).eval()


def experts_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, ToyExperts)]


def snapshot(model: nn.Module) -> dict:
    """Parameter objects and values of every experts module, to prove nothing changed."""
    return {
        (i, n): (p, p.detach().clone())
        for i, m in enumerate(experts_modules(model)) for n, p in m._parameters.items()
    }


def assert_untouched(model: nn.Module, snap: dict, store: MockStore | None) -> None:
    for (i, n), (p, value) in snap.items():
        m = experts_modules(model)[i]
        assert m._parameters[n] is p, f"parameter {n} of experts module {i} was replaced"
        assert p.shape[0] == E and torch.equal(p.detach(), value)
    for m in experts_modules(model):
        assert getattr(m, "_moepage", None) is None and "forward" not in vars(m)
        assert m.num_experts == E
    assert list(moepage.paged_layers(model)) == []
    if store is not None:
        assert store.host_bytes() == 0 and store.inner._host == {} and store.inner._slots == {}


def rejected(model: nn.Module, resident, *fragments: str, use_store: bool = True, **kwargs) -> str:
    """Wrap must raise ConfigError naming every fragment, with nothing allocated or changed."""
    snap = snapshot(model)
    store = MockStore() if use_store else None
    if use_store:
        kwargs.setdefault("backend", store)
    with pytest.raises(moepage.ConfigError) as info:
        moepage.wrap(model, resident, **kwargs)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    assert_untouched(model, snap, store)
    return msg


# -- bad inputs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("resident,fragments", [
    (1, ["blocks.0.experts", "blocks.1.experts", "resident=1", "top_k=2"]),  # below top_k
    (E + 1, ["blocks.0.experts", f"resident={E + 1}", f"num_experts={E}"]),  # above E
    (0, ["blocks.0.experts", "resident=0"]),
    (-3, ["blocks.1.experts", "resident=-3"]),
])
def test_resident_out_of_range(resident, fragments):
    rejected(small_model(), resident, *fragments)


@pytest.mark.parametrize("resident,shown", [(2.5, "2.5"), (True, "True"), ("4", "'4'"), (None, "None"), (4.0, "4.0")])
def test_resident_not_an_integer(resident, shown):
    # resident is one value for the whole model: the message names the argument and the value.
    rejected(small_model(), resident, "resident", shown)


def test_resident_below_top_k_single_module_uses_name():
    module, _ = make_experts(E, H, I, top_k=3)
    rejected(module, 2, "moe.layer7", "resident=2", "top_k=3", name="moe.layer7")
    rejected(module, 2, "ToyExperts", "resident=2")  # default name: the class


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64, torch.bool])
def test_unsupported_dtype(dtype):
    model = small_model()
    m = model.blocks[1].experts
    m.down_proj = nn.Parameter(m.down_proj.detach().to(dtype), requires_grad=False)
    msg = rejected(model, 4, "blocks.1.experts", "'down_proj'", str(dtype))
    assert "blocks.0.experts" not in msg  # only the bad layer is named


def test_meta_device():
    with torch.device("meta"):
        module = ToyExperts(E, H, I, TOP_K)
    snap = {n: p for n, p in module._parameters.items()}
    store = MockStore()
    with pytest.raises(moepage.ConfigError, match=r"layer ToyExperts.*'gate_up_proj'.*meta") as info:
        moepage.wrap(module, 4, backend=store)
    assert "'down_proj'" in str(info.value)
    assert all(module._parameters[n] is p and p.is_meta for n, p in snap.items())
    assert store.host_bytes() == 0 and getattr(module, "_moepage", None) is None


def test_wrap_twice():
    model = small_model()
    first = MockStore()
    moepage.wrap(model, 4, backend=first)
    slots = {(i, n): p for i, m in enumerate(experts_modules(model)) for n, p in m._parameters.items()}
    bytes_before = first.host_bytes()
    second = MockStore()
    with pytest.raises(moepage.ConfigError, match=r"blocks\.0\.experts.*already wrapped"):
        moepage.wrap(model, 4, backend=second)
    with pytest.raises(moepage.ConfigError, match="already wrapped"):
        moepage.wrap(model, 4, backend=first)
    assert second.host_bytes() == 0 and first.host_bytes() == bytes_before
    for (i, n), p in slots.items():
        assert experts_modules(model)[i]._parameters[n] is p and p.shape[0] == 4


def test_wrap_twice_says_only_that():
    model = small_model()
    moepage.wrap(model, 4, backend=MockStore())
    with pytest.raises(moepage.ConfigError) as info:
        moepage.wrap(model, 4, backend=MockStore())
    already = "is already wrapped by moepage (call moepage.unwrap first)"
    assert str(info.value) == (  # said once for both layers; no "expert parameters span devices []" line
        "moepage.wrap: cannot page this model:\n"
        f"  - all 2 layers (blocks.0.experts (ToyExperts), blocks.1.experts (ToyExperts)): {already}"
    )


@pytest.mark.parametrize("use_store", [True, False])
def test_cuda_device_without_cuda(monkeypatch, use_store):
    """Was a MemoryError from the first allocation (torch store) or a torch RuntimeError."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rejected(small_model(), 4, "device='cuda'", "CUDA is not available here", "pass device='cpu'",
             use_store=use_store, device="cuda")


def test_cuda_device_index_beyond_the_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    rejected(small_model(), 4, "device='cuda:5'", "2 CUDA device(s), cuda:0..cuda:1", device="cuda:5")


@pytest.mark.parametrize("device", ["nonsense", "gpu:0"])
def test_device_that_is_not_a_device(device):
    rejected(small_model(), 4, f"device={device!r} is not a torch device", "'cpu'", device=device)


@pytest.mark.parametrize("module", ["model", None, [nn.Linear(2, 2)]])
def test_module_that_is_not_a_module(module):
    with pytest.raises(moepage.ConfigError, match=r"module must be a torch\.nn\.Module .*got (str|NoneType|list)"):
        moepage.wrap(module, 4)


def test_no_experts_module():
    store = MockStore()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    weight = model[0].weight
    with pytest.raises(moepage.ConfigError,
                       match=r"(?s)cannot page Sequential:.*no experts module found.*gate_up_proj"):
        moepage.wrap(model, 4, backend=store)
    with pytest.raises(moepage.ConfigError, match=r"no experts module found.*w1 \+ w9"):
        moepage.wrap(small_model(), 4, backend=store, params=["w1", "w9"])
    assert model[0].weight is weight and store.host_bytes() == 0


def test_unknown_backend():
    rejected(small_model(), 4, "'nvme'", "mock", "torch", use_store=False, backend="nvme")
    rejected(small_model(), 4, "PagedExpertStore", "dict", use_store=False, backend={})


def test_unknown_implementation():
    rejected(small_model(), 4, "'fancy_mm'", "eager", "grouped_mm", implementation="fancy_mm")


def test_unknown_implementation_in_config():
    model = small_model()
    model.blocks[1].experts.config._experts_implementation = "fancy_mm"
    msg = rejected(model, 4, "blocks.1.experts", "'fancy_mm'")
    assert "blocks.0.experts" not in msg
    # An implementation the module does not follow is refused: the module reads its config at every
    # call, so a runner named otherwise would reduce another computation's outputs.
    rejected(model, 4, "blocks.1.experts", "implementation='eager', but ToyExperts runs 'fancy_mm'",
             "switch the module itself", implementation="eager")


def test_num_experts_disagrees():
    model = small_model()
    model.blocks[0].experts.num_experts = E + 2
    snap = snapshot(model)
    store = MockStore()
    with pytest.raises(moepage.ConfigError, match=rf"blocks\.0\.experts.*num_experts={E + 2}.*{E} rows"):
        moepage.wrap(model, 4, backend=store)
    model.blocks[0].experts.num_experts = E
    assert_untouched(model, snap, store)


@pytest.mark.parametrize("argument, stated", [(dict(top_k=TOP_K + 7), f"config.num_experts_per_tok is {TOP_K}"),
                                               (dict(num_experts=E - 1), f"the module's num_experts is {E}")])
def test_an_argument_the_module_contradicts_is_refused_naming_both(argument, stated):
    """``top_k=`` and ``num_experts=`` are for modules that do not say: where a module states another value, the
    argument is refused (the layer, the module's value and the argument named), not silently ignored."""
    (what, given), = argument.items()
    text = rejected(small_model(), 4, "blocks.0.experts", "blocks.1.experts", f"{what}={given} was passed", stated,
                    **argument)
    assert f"pass {what}={stated.rsplit(' ', 1)[1]} or leave it out" in text
    model = small_model()
    moepage.wrap(model, 4, backend=MockStore(), top_k=TOP_K, num_experts=E)  # agreeing: accepted
    assert [layer.num_experts for layer in moepage.paged_layers(model)] == [E, E]


def test_top_k_too_large_at_step():
    module, _ = make_experts(E, H, I, TOP_K)
    moepage.wrap(module, 2, backend="mock")
    x, w = random_inputs(3, H, 3, torch.float32)
    with pytest.raises(moepage.ConfigError, match="top_k=3.*resident=2"):
        module(x, torch.tensor([[0, 1, 2]] * 3), w)
    with pytest.raises(moepage.ConfigError, match=r"\[tokens, top_k\]"):
        module(x, torch.tensor([0, 1, 2]), w)


# -- custom parameter names ------------------------------------------------------------------------
class CustomExperts(nn.Module):
    """SwiGLU experts as ``w1`` (gate), ``w3`` (up), ``w2`` (down), a per-expert bias ``b2 [E, H]``
    and a per-expert scale ``scale [E]`` (both paged: leading dim E), and a shared ``norm [H]``
    (not paged). Eager convention: experts visited in ascending id, rows in (k, token) order."""

    def __init__(self, num_experts: int, hidden: int, inter: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.w1 = nn.Parameter(torch.randn(num_experts, inter, hidden) / hidden**0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, inter, hidden) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, inter) / inter**0.5)
        self.b2 = nn.Parameter(torch.randn(num_experts, hidden))
        self.scale = nn.Parameter(torch.rand(num_experts) + 0.5)
        self.norm = nn.Parameter(torch.rand(hidden) + 0.5)

    def forward(self, hidden, top_k_index, top_k_weights):
        n = self.w1.shape[0]
        h = hidden * self.norm
        out = torch.zeros_like(hidden)
        ids_t = top_k_index.t()  # [k, T]: where() yields (k, token) order
        for e in torch.unique(top_k_index).tolist():
            if not 0 <= e < n:
                continue
            pos, tok = torch.where(ids_t == e)
            x = h[tok]
            y = nn.functional.linear(nn.functional.silu(x @ self.w1[e].t()) * (x @ self.w3[e].t()), self.w2[e])
            y = (y + self.b2[e]) * self.scale[e]
            out.index_add_(0, tok, (y * top_k_weights[tok, pos, None]).to(out.dtype))
        return out


def test_custom_params():
    torch.manual_seed(4)
    e, h, i, top_k = 10, 12, 6, 3
    module = CustomExperts(e, h, i, top_k)
    ref = copy.deepcopy(module)
    norm = module.norm
    store = MockStore()
    assert moepage.find_experts(module) == []
    assert moepage.find_experts(module, ["w1", "w2", "w3"]) == [("", module)]
    moepage.wrap(module, 4, backend=store, params=["w1", "w2", "w3"], name="custom")
    layer = layer_of(module)
    assert set(layer.specs) == {"w1", "w2", "w3", "b2", "scale"}
    assert layer.num_experts == e
    with pytest.raises(moepage.ConfigError, match=f"resident=2 is below top_k={top_k}"):  # its top_k was found
        moepage.wrap(copy.deepcopy(ref), 2, backend=MockStore(), params=["w1", "w2", "w3"])
    for n in layer.specs:
        assert module._parameters[n].shape[0] == 4
        assert torch.equal(store.host_rows("custom", n), ref._parameters[n].detach())
    assert module.norm is norm  # [H] with H != E: not paged
    rng, gen = random.Random(4), torch.Generator().manual_seed(4)
    for tokens in (1, 5, 17, 30):
        pool = rng.sample(range(e), rng.randint(top_k, min(e, tokens * top_k)))
        ids, ref_ids, _ = draw_routing(rng, tokens, top_k, e, pool, pad_frac=0.2)
        x, w = random_inputs(tokens, h, top_k, torch.float32, gen)
        assert torch.equal(module(x, ids, w), ref(x, ref_ids, w))
    assert moepage.stats(module)["custom"].misses > 0
    layer.check_slots()
    moepage.unwrap(module)
    for n in ("w1", "w2", "w3", "b2", "scale"):
        assert torch.equal(module._parameters[n], ref._parameters[n])


# -- unwrap ----------------------------------------------------------------------------------------
def test_unwrap_restores():
    model = small_model(layers=3, seed=8)
    ref = copy.deepcopy(model)
    originals = snapshot(model)
    store = MockStore()
    moepage.wrap(model, 3, backend=store)
    ids = torch.randint(0, 48, (40,))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(ids), ref(ids))
            ids = torch.randint(0, 48, (40,))
    assert moepage.stats(model).total.misses > 0
    assert moepage.unwrap(model) is model
    for (i, n), (_, value) in originals.items():
        p = experts_modules(model)[i]._parameters[n]
        assert p.shape == value.shape and p.dtype == value.dtype and p.device == value.device
        assert torch.equal(p, value)
    for m in experts_modules(model):
        assert "forward" not in vars(m) and not hasattr(m, "_moepage") and m.num_experts == E
    assert dict(moepage.stats(model)) == {} and store.host_bytes() == 0
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))
    moepage.wrap(model, 2, backend=store)  # wrapping again works
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))


def test_unwrap_keeps_instance_forward():
    module, ref = make_experts(E, H, I, TOP_K)
    calls = []

    def traced(hidden, top_k_index, top_k_weights, _inner=module.forward):
        calls.append(hidden.shape[0])
        return _inner(hidden, top_k_index, top_k_weights)

    module.forward = traced
    moepage.wrap(module, 3, backend="mock")
    moepage.unwrap(module)
    assert module.forward is traced
    x, w = random_inputs(4, H, TOP_K, torch.float32)
    ids = torch.tensor([[0, 5], [7, 1], [2, 3], [6, 4]])
    assert torch.equal(module(x, ids, w), ref(x, ids, w)) and calls[-1] == 4


# -- verify mode -----------------------------------------------------------------------------------
class Corrupting(MockStore):
    """Copies the host row of the wrong expert into the slot."""

    def copy_row(self, layer, name, expert, slot):
        super().copy_row(layer, name, (expert + 1) % self.host_rows(layer, name).shape[0], slot)


def _verify_run(store: MockStore, verify, monkeypatch, env: str | None):
    if env is None:
        monkeypatch.delenv("MOEPAGE_VERIFY", raising=False)
    else:
        monkeypatch.setenv("MOEPAGE_VERIFY", env)
    module, ref = make_experts(E, H, I, TOP_K, seed=6)
    moepage.wrap(module, 3, backend=store, verify=verify)
    x, w = random_inputs(4, H, TOP_K, torch.float32)
    ids = torch.tensor([[0, 5], [7, 1], [2, 3], [6, 4]])  # misses: experts 3..7
    return module(x, ids, w), ref(x, ids, w)


@pytest.mark.parametrize("verify,env", [(True, None), (True, "0"), (None, "1")])
def test_verify_catches_corruption(verify, env, monkeypatch):
    with pytest.raises(moepage.VerifyError,
                       match=r"layer ToyExperts: slot \d of '\w+' differs from host row of expert \d"):
        _verify_run(Corrupting(), verify, monkeypatch, env)


@pytest.mark.parametrize("verify,env", [(None, None), (False, "1"), (None, "0")])
def test_verify_off_does_not_check(verify, env, monkeypatch):
    out, want = _verify_run(Corrupting(), verify, monkeypatch, env)
    assert not torch.equal(out, want)  # the corruption is real, just not checked


@pytest.mark.parametrize("verify,env", [(True, None), (None, "1")])
def test_verify_passes_clean_store(verify, env, monkeypatch):
    out, want = _verify_run(MockStore(), verify, monkeypatch, env)
    assert torch.equal(out, want)


def test_verify_multi_wave_steps():
    """Verify mode checks each wave's loads as they land: a step whose later waves reuse the
    slots of earlier ones is not a false alarm."""
    rng, gen = random.Random(12), torch.Generator().manual_seed(12)
    module, ref = make_experts(E, H, I, TOP_K, "grouped_mm", seed=12)
    moepage.wrap(module, 2, backend=MockStore(), verify=True)
    for _ in range(20):
        tokens = rng.randint(1, 9)
        ids, _, _ = draw_routing(rng, tokens, TOP_K, E, rng.sample(range(E), rng.randint(2, min(E, 2 * tokens))))
        x, w = random_inputs(tokens, H, TOP_K, torch.float32, gen)
        assert torch.equal(module(x, ids, w), ref(x, ids, w))
    assert moepage.stats(module)["ToyExperts"].waves > 20


# -- stats -----------------------------------------------------------------------------------------
def test_stats_consistent_with_store():
    model = small_model(layers=3, seed=9)
    store = MockStore()
    moepage.wrap(model, 3, backend=store)
    routed: dict[str, list[int]] = {}
    for name, m in model.named_modules():
        if isinstance(m, ToyExperts):
            m.register_forward_pre_hook(
                lambda mod, args, _n=name: routed.setdefault(_n, []).append(len(torch.unique(args[1])))
            )
    calls = 0
    with torch.no_grad():
        for n in (1, 12, 60, 5):
            model(torch.randint(0, 48, (n,)))
            calls += 1
        out = model.generate(torch.randint(0, 48, (4,)), 3)
        calls += 3
    assert out.shape == (7,)
    st = moepage.stats(model)
    assert list(st) == ["blocks.0.experts", "blocks.1.experts", "blocks.2.experts"]
    for name, s in st.items():
        layer = layer_of(model.get_submodule(name))
        assert s.steps == calls == len(routed[name])
        assert s.hits + s.misses == sum(routed[name])
        assert s.waves >= s.steps
        assert s.bytes_paged == s.misses * layer.pager.row_bytes and s.misses > 0
        assert s.misses == sum(1 for lay, _, _ in store.log if lay == name)
        d = s.as_dict()
        assert d["experts_paged"] == s.misses and d["hit_rate"] == pytest.approx(s.hits / (s.hits + s.misses))
    total = st.total
    assert total.misses == sum(s.misses for s in st.values()) and total.steps == 3 * calls
    assert total.bytes_paged == sum(s.bytes_paged for s in st.values())
    assert store.row_copies == sum(len(layer_of(model.get_submodule(n)).specs) * s.misses for n, s in st.items())


def test_moved_after_wrap_is_an_error():
    model = small_model()
    moepage.wrap(model, 4, backend="mock")
    model.to(torch.float64)
    with pytest.raises(moepage.ConfigError,
                       match=r"layer blocks\.0\.experts: parameter 'gate_up_proj' no longer is moepage's slot table"):
        with torch.no_grad():
            model(torch.randint(0, 48, (5,)))


# -- rollback --------------------------------------------------------------------------------------
class FailingAllocate(MockStore):
    def __init__(self, fail_on: int):
        super().__init__()
        self.calls, self.fail_on = 0, fail_on

    def allocate(self, layer, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_on:
            raise MemoryError(f"layer {layer}: no room")
        super().allocate(layer, *args, **kwargs)


class FailingHostRows(MockStore):
    """Fails while wrap copies a layer's weights into its host rows (after allocate)."""

    def __init__(self, layer: str):
        super().__init__()
        self.bad = layer

    def write_rows(self, layer, name, rows, **kwargs):
        if layer == self.bad and name == "down_proj":
            raise RuntimeError("host rows unwritable")
        return super().write_rows(layer, name, rows, **kwargs)


@pytest.mark.parametrize("store,error", [
    (lambda: FailingAllocate(3), MemoryError),
    (lambda: FailingAllocate(1), MemoryError),
    (lambda: FailingHostRows("blocks.2.experts"), RuntimeError),
])
def test_rollback_of_failed_wrap(store, error):
    model = small_model(layers=4, seed=10)
    ref = copy.deepcopy(model)
    snap = snapshot(model)
    st = store()
    with pytest.raises(error):
        moepage.wrap(model, 3, backend=st)
    for (i, n), (_, value) in snap.items():
        p = experts_modules(model)[i]._parameters[n]
        assert p.shape[0] == E and torch.equal(p, value)
    for m in experts_modules(model):
        assert "forward" not in vars(m) and not hasattr(m, "_moepage") and m.num_experts == E
    assert st.host_bytes() == 0 and st.inner._host == {} and st.inner._slots == {}
    ids = torch.randint(0, 48, (25,))
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))
    moepage.wrap(model, 3, backend=MockStore())  # a later wrap works
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))


def test_backend_auto_selection_survives_importing_the_torch_backend(monkeypatch):
    # Regression: ``moepage.backends.torch`` (the submodule) once shadowed ``torch`` inside
    # ``moepage.backends``, so auto-selection crashed on CUDA after the torch backend was used.
    import moepage.backends as backends
    import moepage.backends.torch  # noqa: F401

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA
    assert backends.cuda_backend_available() is False
    assert backends.resolve(None, torch.device("cpu")).name == "torch"


def test_cuda_backend_unavailable_without_cuda_python(monkeypatch):
    import sys

    import moepage.backends as backends

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # CUDA runs ...
    monkeypatch.delitem(sys.modules, "moepage.backends.cuda", raising=False)
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver"):  # ... but cuda-python does not import
        monkeypatch.setitem(sys.modules, name, None)
    assert backends.cuda_backend_available() is False
    assert backends.resolve(None, torch.device("cuda")).name == "torch"
    with pytest.raises(moepage.ConfigError, match=r"backend 'cuda' is not installed here: .*moepage\[cuda\]"):
        backends.resolve("cuda", torch.device("cuda"))


def test_device_planner_without_a_gathering_store_fails_before_allocating():
    from moepage.backends.mock import MockStore
    from moepage.toy import ToyExperts

    module = ToyExperts(8, 16, 32, 2)
    before = module.gate_up_proj
    store = MockStore()
    store.can_gather = lambda device: False  # a store that cannot gather a device-made plan
    with pytest.raises(moepage.ConfigError, match="device_planner=True"):
        moepage.wrap(module, resident=4, backend=store, device_planner=True)
    assert store.host_bytes() == 0 and module.gate_up_proj is before


# -- policy, per-layer budgets, prefill admission -----------------------------------------------
def test_policy_reaches_both_planners():
    model = small_model()
    moepage.wrap(model, 4, backend="torch", device_planner=True, policy="lfru:8")
    for layer in moepage.paged_layers(model):
        assert layer.pager.residency.policy.half_life == 8 and layer.pager.device_state.state.policy.half_life == 8
    other = small_model()
    moepage.wrap(other, 4, backend=MockStore())
    assert all(layer.pager.residency.policy.name == moepage.DEFAULT_POLICY for layer in moepage.paged_layers(other))


def test_bad_policy():
    rejected(small_model(), 4, "policy", "unknown policy 'mru'", policy="mru")
    rejected(small_model(), 4, "half_life must be an integer in 0..1024", policy="lfu:5000")


def test_per_layer_budget_mapping_path_and_indices(tmp_path):
    import json

    model = small_model(layers=3)
    ref = copy.deepcopy(model)
    split = {"blocks.0.experts": 3, 1: 5, "blocks.2.experts": 8}
    moepage.wrap(model, split, backend=MockStore())
    assert [layer.num_slots for layer in moepage.paged_layers(model)] == [3, 5, 8]
    assert [m.gate_up_proj.shape[0] for m in experts_modules(model)] == [3, 5, 8]
    ids = torch.randint(0, 48, (20,))
    assert torch.equal(model(ids), ref(ids))
    path = tmp_path / "split.json"
    path.write_text(json.dumps({"layers": {"0": 2, "1": 4, "2": 6}, "budget": 12}))
    again = small_model(layers=3)
    moepage.wrap(again, str(path), backend=MockStore())
    assert [layer.num_slots for layer in moepage.paged_layers(again)] == [2, 4, 6]


@pytest.mark.parametrize("resident,fragments", [
    ({"blocks.0.experts": 3}, ["resident split: layer 'blocks.1.experts' has no K; the layers are 'blocks.0.experts', "
                               "'blocks.1.experts' (or their indices 0..1)"]),
    ({0: 3, 1: 3, "blocks.9.experts": 4}, ["resident split: keys 'blocks.9.experts' name no experts module of this "
                                           "model; the layers are"]),
    ({}, ["resident split: no layer has a K; the layers are"]),
    ({0: 3, 1: 1}, ["blocks.1.experts", "resident=1", "top_k=2"]),
    ({0: 3, 1: "x"}, ["resident['blocks.1.experts'] must be an integer"]),
    ("/no/such/split.json", ["not a readable split file"]),
    ("4", ["resident='4' is a string, read as a split file's path, and there is no such file; K must be an int "
           "(e.g. resident=4)"]),
    (" 2.5", ["resident=' 2.5' is a string, read as a split file's path", "K must be an int (e.g. resident=4)"]),
])
def test_bad_per_layer_budget(resident, fragments):
    msg = rejected(small_model(), resident, *fragments)
    assert "[]" not in msg and "a split of another model" not in msg  # only the parts that are wrong are named


def test_a_split_file_of_another_model_says_so(tmp_path):
    """A split file written by ``moepage plan --out`` for a model of other layers, E and top_k names the keys that
    are not this model's and how its routing differs; one keyed by another model's module names says so too."""
    import json

    from moepage.planning import budgets

    path = tmp_path / "split.json"
    budgets.save_split(budgets.Split([4, 4, 4, 4], 16, "lfu", "other", 16, 4, [[0] * 13] * 4), path)
    msg = rejected(small_model(), str(path), f"resident={str(path)!r} (a split file): keys 2, 3 name no experts module "
                   "of this model; it looks like a split of another model: it was planned for E=16 experts, not 8, "
                   "and top_k=4, not 2; the layers are 'blocks.0.experts', 'blocks.1.experts' (or their indices 0..1)")
    assert "have no K" not in msg
    path.write_text(json.dumps({"layers": {"model.layers.0.mlp.experts": 3, "model.layers.1.mlp.experts": 3}}))
    msg = rejected(small_model(), str(path), "keys 'model.layers.0.mlp.experts', 'model.layers.1.mlp.experts' name no "
                   "experts module of this model and no layer has a K; it looks like a split of another model; the "
                   "layers are")
    assert "planned for" not in msg  # the file does not say its E and top_k


def test_a_string_resident_is_a_split_file_even_where_it_reads_as_a_number(tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "4").write_text(json.dumps({"layers": {"0": 3, "1": 5}}))
    model = small_model()
    moepage.wrap(model, "4", backend=MockStore())
    assert [layer.num_slots for layer in moepage.paged_layers(model)] == [3, 5]


def test_prefill_admission_keeps_slots():
    """K = 4 of E = 8: a prefill routing all 8 evicts 4 slots, or 2 with prefill_admit=2."""
    for admit, changed in ((None, 4), (2, 2)):
        model = small_model(layers=1)
        ref = copy.deepcopy(model)
        moepage.wrap(model, 4, backend=MockStore(), prefill_admit=admit, policy="lru")
        layer = next(moepage.paged_layers(model))
        before = layer.read_residency().slot_expert[:]
        ids = torch.randint(0, 48, (40,))  # 40 tokens x top-2 route every expert: several waves
        assert torch.equal(model(ids), ref(ids))
        assert sum(a != b for a, b in zip(before, layer.read_residency().slot_expert)) == changed
    rejected(small_model(), 4, "prefill_admit=5 is outside 1..K=4", prefill_admit=5)
    rejected(small_model(), 4, "prefill_admit=1 is outside 2..K=4", prefill_admit=1, prefill_overlap=True)


def test_generic_runner_without_installed_providers_warns_once(monkeypatch, caplog):
    """From a source tree without package metadata the integrations' runners are not registered:
    wrap says so (once) instead of silently using the generic runner (not bit-exact on CUDA)."""
    import logging

    from moepage import contract as runners
    from moepage.toy import ToyExperts

    monkeypatch.setattr(runners, "_providers_loaded", True)
    monkeypatch.setattr(runners, "_providers", [])
    monkeypatch.setattr(runners, "_warned_no_providers", False)
    module = torch.nn.Module()
    with caplog.at_level(logging.WARNING, logger="moepage"):
        assert runners.runner_for(module) is runners.EXPERT_ORDER
        runners.runner_for(module)
    said = [r for r in caplog.records if "no runner provider is installed" in r.getMessage()]
    assert len(said) == 1 and "Module" in said[0].getMessage()
    monkeypatch.setattr(runners, "_providers", ["moepage.integrations.transformers.runners:register"])
    monkeypatch.setattr(runners, "_warned_no_providers", False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moepage"):
        runners.runner_for(ToyExperts(4, 8, 8, 2, "eager"))
    assert not [r for r in caplog.records if "no runner provider" in r.getMessage()]
