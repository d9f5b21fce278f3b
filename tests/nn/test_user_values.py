"""Values a new user passes, found by trying moepage as one would: each is either served exactly or refused once, with
the value, where it went wrong and what is allowed, before anything is allocated."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import moepage
from helpers.hf import make_checkpoints
from moepage.backends.mock import MockStore
from moepage.bits import same_bits
from moepage.integrations import transformers as mhf
from moepage.toy import ToyExperts, ToyMoE

pytestmark = pytest.mark.usefixtures("single_thread")

E, H, I, TOP_K = 8, 16, 8, 2


def small_model(layers: int = 2, dtype=torch.float32) -> ToyMoE:
    torch.manual_seed(0)
    return ToyMoE(vocab=48, hidden=H, inter=I, layers=layers, num_experts=E, top_k=TOP_K).to(dtype).eval()


def refused(call, *fragments: str, absent: tuple[str, ...] = ()) -> str:
    with pytest.raises(moepage.ConfigError) as info:
        call()
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    for fragment in absent:
        assert fragment not in msg, f"{fragment!r} in {msg!r}"
    return msg


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoints(tmp_path_factory)


# -- NaN weights: the check step compares bit patterns --------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("expert", [0, E - 1])  # resident at wrap (slot 0), or paged in later
def test_an_expert_holding_nan_pages_bit_for_bit(dtype, expert):
    torch.manual_seed(0)
    module = ToyExperts(E, H, I, TOP_K).to(dtype)
    with torch.no_grad():
        module.down_proj[expert, 0, 0] = float("nan")
        if dtype == torch.bfloat16:  # and a weight that overflows to inf in bf16
            module.gate_up_proj[expert, 1, 1] = 3.0e38
    ref = copy.deepcopy(module)
    moepage.wrap(module, 3)
    x = torch.randn(6, H, dtype=dtype)
    w = torch.full((6, TOP_K), 0.5, dtype=dtype)
    for ids in ([[expert, 1]] * 6, [[2, 3]] * 6, [[e, (e + 1) % E] for e in range(6)]):  # one wave, two, many
        ids = torch.tensor(ids)
        got, want = module(x, ids, w), ref(x, ids, w)
        assert same_bits(got, want)
    assert torch.isnan(module(x, torch.tensor([[expert, 1]] * 6), w)).any()


def test_a_model_with_a_nan_weight_runs():
    model = small_model()
    with torch.no_grad():
        model.blocks[0].experts.down_proj[0, 0, 0] = float("nan")  # expert 0: resident at wrap
    ref = copy.deepcopy(model)
    moepage.wrap(model, 3)
    for ids in (torch.arange(48) % 48, torch.tensor([5])):
        assert same_bits(model(ids), ref(ids))


# -- devices are compared as tensors report them -----------------------------------------------------------------
def test_device_cpu_0_is_cpu():
    model = small_model()
    ref = copy.deepcopy(model)
    moepage.wrap(model, 3, device="cpu:0")
    ids = torch.arange(30) % 48
    assert same_bits(model(ids), ref(ids))
    moepage.unwrap(model)


def test_from_pretrained_on_cpu_0(checkpoint):
    path, k = checkpoint("qwen3_moe")
    ids = torch.arange(20).unsqueeze(0)
    model = mhf.from_pretrained(path, k, device="cpu:0", progress=False)
    want = mhf.from_pretrained(path, k, device="cpu", progress=False)(ids).logits
    assert same_bits(model(ids).logits, want)


# -- experts modules wrapped one by one -----------------------------------------------------------------------------
def test_experts_wrapped_one_by_one_are_each_counted():
    model = small_model(layers=3)
    for block in model.blocks:
        moepage.wrap(block.experts, resident=3)
    model(torch.arange(10))
    stats = moepage.stats(model)
    assert sorted(stats) == [f"blocks.{i}.experts" for i in range(3)]
    assert all(s.steps == 1 for s in stats.values())
    assert sorted(moepage.host_bytes(model)) == sorted(stats)


# -- K that is no number: said once, with the rule it breaks --------------------------------------------------------
@pytest.mark.parametrize("resident", [2.5, None, True, "6"])
def test_an_unreadable_k_is_said_once(resident):
    refused(lambda: moepage.wrap(small_model(), resident, backend=MockStore()), "resident", absent=("resident=0",))


def test_a_missing_split_file_is_said_once(tmp_path):
    refused(lambda: moepage.wrap(small_model(), str(tmp_path / "none.json")), "none.json", absent=("resident=0",))


def test_the_k_rule_names_top_k_as_its_floor():
    msg = refused(lambda: moepage.wrap(small_model(), E + 1), f"resident={E + 1}")
    assert f"top_k={TOP_K}..num_experts={E}" in msg and "1..num_experts" not in msg


def test_a_split_naming_a_layer_twice():
    split = {0: 4, "blocks.0.experts": 5, 1: 3}
    refused(lambda: moepage.wrap(small_model(), split), "blocks.0.experts", "twice")


# -- arguments of the wrong kind --------------------------------------------------------------------------------------
def test_load_that_is_no_function():
    store = MockStore()
    refused(lambda: moepage.wrap(small_model(), 3, backend=store, load=5), "load=5", "not callable")
    assert store.host_bytes() == 0 and store.inner._host == {}


def test_params_given_as_one_string():
    msg = refused(lambda: moepage.wrap(small_model(), 3, params="gate_up_proj"), "params='gate_up_proj'", "list")
    assert "g + a" not in msg


# -- the environment: every variable read, wherever it applies ---------------------------------------------------------
BAD_ENV = {
    "MOEPAGE_DEVICE_PLANNER": "maybe",
    "MOEPAGE_BACKEND": "gpu",
    "MOEPAGE_SPLIT": "/nonexistent/split.json",
    "MOEPAGE_KV_RESERVE_FRACTION": "2",
}


@pytest.mark.parametrize("name", sorted(BAD_ENV))
def test_a_bad_variable_is_refused_by_wrap(monkeypatch, name):
    monkeypatch.setenv(name, BAD_ENV[name])
    store = MockStore()
    refused(lambda: moepage.wrap(small_model(), 3, backend=store), name, repr(BAD_ENV[name]))
    assert store.host_bytes() == 0


@pytest.mark.parametrize("name", sorted(BAD_ENV))
def test_a_bad_variable_is_refused_by_from_pretrained(monkeypatch, checkpoint, name):
    path, k = checkpoint("qwen3_moe")
    monkeypatch.setenv(name, BAD_ENV[name])
    refused(lambda: mhf.from_pretrained(path, k, device="cpu", progress=False), name)


def test_moepage_backend_applies_to_wrap(monkeypatch):
    monkeypatch.setenv("MOEPAGE_BACKEND", "mock")
    model = small_model()
    moepage.wrap(model, 3)
    assert {layer.store.name for layer in moepage.paged_layers(model)} == {"mock"}


# -- Hugging Face's own keywords -------------------------------------------------------------------------------------
def test_from_pretrained_takes_torch_dtype(checkpoint):
    path, k = checkpoint("qwen3_moe")
    model = mhf.from_pretrained(path, k, device="cpu", torch_dtype=torch.bfloat16, progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_from_pretrained_refuses_device_map_auto_saying_what_to_pass(checkpoint):
    path, k = checkpoint("qwen3_moe")
    msg = refused(lambda: mhf.from_pretrained(path, k, device_map="auto"), "device_map='auto'", "device='cuda'")
    assert "wrap()" not in msg


def test_from_pretrained_names_itself_for_an_unknown_keyword(checkpoint):
    path, k = checkpoint("qwen3_moe")
    refused(lambda: mhf.from_pretrained(path, k, devcie="cpu"), "from_pretrained", "devcie=")


def test_from_pretrained_progress_no_shows_no_bar(checkpoint, capsys):
    path, k = checkpoint("qwen3_moe")
    mhf.from_pretrained(path, k, device="cpu", progress="no")
    assert "moepage: loading" not in capsys.readouterr().err
    refused(lambda: mhf.from_pretrained(path, k, device="cpu", progress="maybe"), "progress='maybe'")


# -- capture_mode on a layer that plans on the host ------------------------------------------------------------------
def test_capture_mode_on_a_host_planned_layer_says_capture_mode():
    module = ToyExperts(E, H, I, TOP_K)
    moepage.wrap(module, 3, device_planner=False)
    x = torch.randn(2, H)
    ids, w = torch.tensor([[0, 1], [2, 3]]), torch.full((2, 2), 0.5)
    msg = refused(lambda: _captured(module, x, ids, w), "capture_mode", absent=("a CUDA graph is being captured",))
    assert "device_planner=True" in msg


def _captured(module: nn.Module, x, ids, w):
    with moepage.capture_mode():
        module(x, ids, w)
