"""``wrap(..., compress=True)``: the host store keeps bf16 rows coded (``moepage.compress``), page-ins
decode them, and paged still equals unpaged bit for bit (``torch.equal``), host- and
device-planned; state_dict, load_state_dict, verify and unwrap see the original rows."""

from __future__ import annotations

import copy
import random
import warnings
import zlib

import pytest
import torch

import moepage
from helpers.models import layer_of, make_experts
from helpers.routing import draw_routing, expected_waves, pool_for_waves, random_inputs
from moepage import compress as C
from moepage.backends.mock import MockStore

pytestmark = pytest.mark.usefixtures("single_thread")

E, H, I, TOP_K = 16, 64, 32, 2


def wrapped(k: int, backend="torch", seed: int = 0, **kw):
    paged, ref = make_experts(E, H, I, TOP_K, kw.pop("impl", "eager"), torch.bfloat16, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every tensor here is coded: no "kept raw" warning
        moepage.wrap(paged, resident=k, backend=backend, compress=True, **kw)
    return paged, ref


@pytest.mark.parametrize("backend,planner", [("torch", None), ("torch", True), ("mock", None)],
                         ids=["host-planned", "device-planned", "mock"])
@pytest.mark.parametrize("k", [TOP_K, 6, E])
def test_compressed_paged_equals_unpaged(backend, planner, k):
    seed = zlib.crc32(f"{backend}{planner}{k}".encode())
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    paged, ref = wrapped(k, backend, seed=seed % 1000, device_planner=planner)
    layer = layer_of(paged)
    assert all(spec.code is not None for spec in layer.specs.values())
    for waves in ("one", "two", "many", "one", "many"):
        tokens = rng.choice([1, 7, 40])
        if waves != "one" and (k == E or tokens * TOP_K <= k):
            tokens = 40
        if waves != "one" and k == E:
            waves = "one"
        ids, ref_ids, distinct = draw_routing(rng, tokens, TOP_K, E, pool_for_waves(rng, E, k, TOP_K, tokens, waves))
        x, w = random_inputs(tokens, H, TOP_K, torch.bfloat16, gen)
        before = moepage.stats(paged)[layer.name].waves
        assert torch.equal(paged(x, ids, w), ref(x, ref_ids, w))
        assert moepage.stats(paged)[layer.name].waves - before == expected_waves(len(distinct), k)
    stats = moepage.stats(paged)[layer.name]
    assert (stats.misses > 0) == (k < E)
    layer.check_slots()


def test_host_store_shrinks_and_reports_it():
    paged, ref = wrapped(4, "torch")
    held = moepage.host_bytes(paged)
    assert list(held) == [layer_of(paged).name]
    report = held[layer_of(paged).name]
    raw = (ref.gate_up_proj.numel() + ref.down_proj.numel()) * 2
    assert report.raw == raw and report.coded == ("gate_up_proj", "down_proj")
    assert report.held == layer_of(paged).store.host_bytes() < raw
    assert 1.28 < report.ratio < 4 / 3
    plain, _ = make_experts(E, H, I, TOP_K, "eager", torch.bfloat16)
    moepage.wrap(plain, resident=4, backend="torch")
    assert moepage.host_bytes(plain)[layer_of(plain).name].held == raw


def test_state_dict_unwrap_and_load_state_dict_see_the_original_rows():
    paged, ref = wrapped(3, "mock")
    x, w = random_inputs(20, H, TOP_K, torch.bfloat16, torch.Generator().manual_seed(1))
    ids = torch.stack([torch.randperm(E)[:TOP_K] for _ in range(20)])
    assert torch.equal(paged(x, ids, w), ref(x, ids, w))
    state = paged.state_dict()
    for n in ("gate_up_proj", "down_proj"):
        assert torch.equal(state[n].view(torch.int16), getattr(ref, n).detach().view(torch.int16))
    # New weights that fit the code (escapes within its capacity): coded, and the resident slots follow.
    other, _ = make_experts(E, H, I, TOP_K, "eager", torch.bfloat16, seed=0)
    other.down_proj.data[:, :, :] = ref.down_proj.data.flip(0)
    paged.load_state_dict({"gate_up_proj": ref.gate_up_proj.data, "down_proj": other.down_proj.data})
    ref.load_state_dict({"gate_up_proj": ref.gate_up_proj.data, "down_proj": other.down_proj.data})
    assert torch.equal(paged(x, ids, w), ref(x, ids, w))
    layer_of(paged).check_slots()
    moepage.unwrap(paged)
    assert paged.gate_up_proj.shape[0] == E and torch.equal(paged.down_proj, ref.down_proj)


def test_load_state_dict_refuses_rows_the_code_cannot_hold():
    paged, ref = wrapped(3, "torch")
    odd = ref.down_proj.detach().clone()
    odd.view(torch.int16)[5, :, :] = 0x0001  # every weight a denormal: all escape
    with pytest.raises(moepage.ConfigError, match=r"expert 5 of 'down_proj' has 2048 weights outside"):
        paged.load_state_dict({"down_proj": odd}, strict=False)
    layer_of(paged).check_slots()  # the slots still hold what the host rows do
    x, w = random_inputs(9, H, TOP_K, torch.bfloat16, torch.Generator().manual_seed(2))
    ids = torch.stack([torch.randperm(E)[:TOP_K] for _ in range(9)])
    assert torch.equal(paged(x, ids, w), ref(x, ids, w))


def test_verify_compares_coded_rows_with_the_weights_at_wrap(monkeypatch):
    wrapped(4, "torch", verify=True)  # they agree

    encode = C.encode_rows

    def corrupt(rows, code, device="cpu"):
        out = encode(rows, code, device)
        out[-1, 0] ^= 1  # one bit of the sign|mantissa plane of the last expert of each K=4
        return out

    monkeypatch.setattr(C, "encode_rows", corrupt)
    paged, ref = make_experts(E, H, I, TOP_K, "eager", torch.bfloat16)
    with pytest.raises(moepage.VerifyError, match="expert 3 of 'gate_up_proj' does not read back as its weights"):
        moepage.wrap(paged, resident=4, backend="torch", compress=True, verify=True)
    assert paged.gate_up_proj.shape[0] == E and torch.equal(paged.gate_up_proj, ref.gate_up_proj)  # rolled back


def test_unsupported_dtypes_are_refused_before_allocating(monkeypatch):
    store = MockStore()
    fp32, _ = make_experts(E, H, I, TOP_K, "eager", torch.float32)
    with pytest.raises(moepage.ConfigError) as info:
        moepage.wrap(fp32, resident=4, backend=store, compress=True, name="experts")
    text = str(info.value)
    assert "layer experts (ToyExperts)" in text and "'gate_up_proj' is torch.float32" in text
    assert "codes bfloat16 expert rows only" in text and text.count("torch.float32") == 2
    assert "(from_pretrained: dtype=torch.bfloat16)" in text  # the way to cast, for a load
    assert store.inner.host_bytes() == 0 and store.log == []
    monkeypatch.setenv("MOEPAGE_COMPRESS", "1")
    with pytest.raises(moepage.ConfigError, match="codes bfloat16 expert rows only"):
        moepage.wrap(copy.deepcopy(fp32), resident=4, backend="torch")
    fp16 = copy.deepcopy(fp32).half()
    with pytest.raises(moepage.ConfigError, match="float16 keeps 11 sign"):
        moepage.wrap(fp16, resident=4, backend="torch")
    bf16, _ = make_experts(E, H, I, TOP_K, "eager", torch.bfloat16)
    monkeypatch.setenv("MOEPAGE_COMPRESS", "yes please")
    with pytest.raises(moepage.ConfigError, match="MOEPAGE_COMPRESS='yes please' is not a flag"):
        moepage.wrap(bf16, resident=4, backend="torch")


def test_a_tensor_the_code_cannot_shrink_stays_raw_with_a_warning():
    paged, _ = make_experts(E, H, 4, TOP_K, "eager", torch.bfloat16)
    with torch.no_grad():  # 40 exponents in every row of down_proj: 25 of 40 weights escape
        paged.down_proj[:] = (2.0 ** -(torch.arange(H * 4) % 40)).reshape(H, 4)
    ref = copy.deepcopy(paged)
    said = r"keeps 1 expert tensor\(s\) raw: x.down_proj: row 0 escapes \d+ of its 256 weights, over the cap"
    with pytest.warns(UserWarning, match=said):
        moepage.wrap(paged, resident=4, backend="torch", compress=True, name="x")
    store = layer_of(paged).store
    assert store.code("x", "down_proj") is None and store.code("x", "gate_up_proj") is not None
    assert moepage.host_bytes(paged)["x"].coded == ("gate_up_proj",)
    assert store.host_rows("x", "down_proj").dtype == torch.bfloat16  # the raw rows themselves
    x, w = random_inputs(30, H, TOP_K, torch.bfloat16, torch.Generator().manual_seed(3))
    ids = torch.stack([torch.randperm(E)[:TOP_K] for _ in range(30)])
    assert torch.equal(paged(x, ids, w), ref(x, ids, w))
    assert moepage.stats(paged).total.misses > 0


def test_a_failed_coded_page_in_leaves_the_next_step_exact():
    for fail in (1, 4):
        paged, ref = make_experts(E, H, I, TOP_K, "eager", torch.bfloat16, seed=fail)
        moepage.wrap(paged, resident=4, backend=MockStore(fail_at={fail}), compress=True)
        x, w = random_inputs(40, H, TOP_K, torch.bfloat16, torch.Generator().manual_seed(fail))
        ids = torch.stack([torch.randperm(E)[:TOP_K] for _ in range(40)])
        with pytest.raises(moepage.PageInError, match=f"row copy #{fail}"):
            paged(x, ids, w)
        layer_of(paged).check_slots()  # every slot the residency trusts decodes to its expert
        assert torch.equal(paged(x, ids, w), ref(x, ids, w))


def test_trained_tiny_model_paged_compressed_equals_unpaged(one_thread):
    import transformers  # noqa: F401  (the [test] extra installs it)
    from transformers import AutoModelForCausalLM

    from helpers.tiny import CKPT, text_tokens

    ref = AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.bfloat16).eval()
    paged = copy.deepcopy(ref)
    k = ref.config.num_experts_per_tok + 2
    moepage.wrap(paged, resident=k, backend="torch", compress=True)
    held = moepage.host_bytes(paged)
    assert len(held) == ref.config.num_hidden_layers
    total = sum(held.values(), moepage.HostBytes(raw=0, held=0))
    assert all(h.coded == ("gate_up_proj", "down_proj") for h in held.values())
    assert 1.28 < total.ratio < 4 / 3
    tokens = text_tokens(48)
    with torch.no_grad():
        for start in (0, 24):
            assert torch.equal(paged(tokens[:, start : start + 24]).logits, ref(tokens[:, start : start + 24]).logits)
    assert moepage.stats(paged).total.misses > 0


def test_coding_shows_progress_on_a_terminal(monkeypatch, capsys):
    """Coding the host rows at wrap draws its bars on stderr where it is a terminal (tqdm), and nothing elsewhere."""
    import sys

    import tqdm  # noqa: F401  (the [test] extra installs it)

    wrapped(4)
    assert "moepage:" not in capsys.readouterr().err  # not a terminal: silent
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    wrapped(4)
    err = capsys.readouterr().err
    assert "moepage: coding host rows" in err and "1/1" in err  # one bar: each layer planned, then coded
