"""A paged experts module as a ``torch.nn.Module``: ``state_dict`` gives all E expert rows,
``load_state_dict`` fills them (or refuses K-row entries), grad mode is refused where gradients
would be silently wrong, and ``unwrap`` gives back each parameter's ``requires_grad``."""

from __future__ import annotations

import copy

import pytest
import torch

import moepage
from moepage.backends.mock import MockStore
from moepage.toy import ToyMoE

E, K = 8, 3


def small_model(seed: int = 0) -> ToyMoE:
    torch.manual_seed(seed)
    return ToyMoE(vocab=48, hidden=16, inter=8, layers=2, num_experts=E, top_k=2).eval()


def run(model: torch.nn.Module, steps: int = 3, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [model(torch.randint(0, 48, (30,), generator=gen)) for _ in range(steps)]


def assert_same_state(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, value in want.items():
        assert got[name].shape == value.shape and torch.equal(got[name].cpu(), value.cpu()), name


# -- state_dict ----------------------------------------------------------------------------------
def test_state_dict_gives_every_expert_row():
    model = small_model()
    want = copy.deepcopy(model.state_dict())
    moepage.wrap(model, K)
    run(model)  # slots now hold other experts than 0..K-1
    got = model.state_dict()
    assert got["blocks.0.experts.gate_up_proj"].shape[0] == E  # was K: a corrupt checkpoint
    assert_same_state(got, want)
    assert model.blocks[0].experts.gate_up_proj.shape[0] == K  # the module still computes on slots


def test_state_dict_of_the_experts_module_itself():
    model = small_model()
    experts = model.blocks[1].experts
    want = copy.deepcopy(experts.state_dict())
    moepage.wrap(experts, K, name="L1")
    assert_same_state(experts.state_dict(prefix="x."), {f"x.{n}": v for n, v in want.items()})


# -- load_state_dict -----------------------------------------------------------------------------
def test_load_state_dict_fills_host_rows_and_resident_slots():
    model, other = small_model(seed=0), small_model(seed=5)
    ref = copy.deepcopy(other)
    moepage.wrap(model, K)
    run(model)
    layer = next(moepage.paged_layers(model))
    resident = [e for e in layer.read_residency().slot_expert if e >= 0]
    assert resident != list(range(K))  # slots refreshed must be the resident experts, not 0..K-1
    result = model.load_state_dict(other.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert_same_state(model.state_dict(), ref.state_dict())
    for layer in moepage.paged_layers(model):
        layer.check_slots()  # every resident slot equals its (new) host row
    for got, want in zip(run(model, seed=2), run(ref, seed=2)):
        assert torch.equal(got, want)


def test_load_state_dict_refuses_slot_rows():
    model = small_model()
    moepage.wrap(model, K)
    truncated = {n: v[:K] if ".experts." in n else v for n, v in small_model(seed=5).state_dict().items()}
    with pytest.raises(moepage.ConfigError, match=r"layer blocks\.0\.experts: load_state_dict entry "
                       r"'blocks\.0\.experts\.gate_up_proj' has shape \(3, 16, 16\); .* all 8 experts: \(8, 16, 16\)"):
        model.load_state_dict(truncated)


def test_unwrap_removes_the_hooks():
    model = small_model()
    experts = model.blocks[0].experts
    hooks = lambda m: (len(m._state_dict_hooks), len(m._load_state_dict_pre_hooks), len(m._forward_pre_hooks))
    assert hooks(experts) == (0, 0, 0)
    moepage.wrap(model, K, backend=MockStore())
    assert hooks(experts) == (1, 1, 1)
    moepage.unwrap(model)
    assert hooks(experts) == (0, 0, 0)


# -- grad mode -----------------------------------------------------------------------------------
def test_grad_mode_on_parameters_requiring_grad_is_refused():
    model = small_model()  # nn.Parameter default: requires_grad=True, as HF models come
    moepage.wrap(model, K)
    ids = torch.randint(0, 48, (10,))
    with torch.enable_grad():
        with pytest.raises(moepage.ConfigError, match=r"layer blocks\.0\.experts: moepage computes no gradients, "
                           r"but grad mode is on and its expert parameters \['gate_up_proj', 'down_proj'\] require "
                           r"grad; run the model under torch\.no_grad\(\) or torch\.inference_mode\(\), or call "
                           r"model\.requires_grad_\(False\)"):
            model(ids)


def test_grad_mode_on_inputs_requiring_grad_is_refused():
    """Frozen experts but a trainable rest (fine-tuning around them): the gradient through the
    experts would be silently missing."""
    model = small_model()
    for block in model.blocks:
        block.experts.requires_grad_(False)
    moepage.wrap(model, K)
    with torch.enable_grad(), pytest.raises(moepage.ConfigError, match=r"its inputs require grad"):
        model(torch.randint(0, 48, (10,)))


def test_inference_runs_under_no_grad_inference_mode_or_frozen_parameters():
    model = small_model()
    ref = copy.deepcopy(model)
    moepage.wrap(model, K)
    ids = torch.randint(0, 48, (20,))
    with torch.no_grad():
        want = ref(ids)
        assert torch.equal(model(ids), want)
    with torch.inference_mode():
        assert torch.equal(model(ids), want)
    with torch.enable_grad():
        model.requires_grad_(False)  # after wrap works too: the slots carry the flag
        assert torch.equal(model(ids), want)


def test_unwrap_restores_requires_grad():
    model = small_model()
    model.blocks[0].experts.down_proj.requires_grad_(False)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    assert any(before.values()) and not all(before.values())
    moepage.wrap(model, K)
    moepage.unwrap(model)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before  # was: all expert params False


# -- in-place edits, copies, pickling, inference mode -----------------------------------------------
def test_state_dict_entries_edited_in_place_reach_the_slots():
    """A state_dict() entry is the host rows: writing into it in place is followed at the next
    step (the resident experts' slots are refreshed), so the model computes the edited weights."""
    model = small_model()
    ref = copy.deepcopy(model)
    moepage.wrap(model, K)
    run(model)  # other experts than 0..K-1 are resident now
    for m in (model, ref):
        m.state_dict()["blocks.0.experts.gate_up_proj"][1:6].mul_(1.5)
        m.state_dict()["blocks.1.experts.down_proj"].add_(0.25)
    assert all(torch.equal(a, b) for a, b in zip(run(model), run(ref)))
    moepage.unwrap(model)  # the edit is what unwrap gives back
    assert_same_state(model.state_dict(), ref.state_dict())


def test_parameters_edited_in_place_are_refused():
    """parameters() are the K-row slot tables: an in-place edit would reach only the resident
    experts and be undone by the next page-in. The step refuses it, and so does unwrap (which
    would drop it) unless told to discard it."""
    model = small_model()
    original = copy.deepcopy(model)
    moepage.wrap(model, K)
    run(model)
    model.blocks[1].experts.down_proj.mul_(2)
    with pytest.raises(moepage.ConfigError, match=r"blocks\.1\.experts: 'down_proj' \(the slot table of the K=3"):
        run(model)
    with pytest.raises(moepage.ConfigError, match=r"would be lost: \{'blocks\.1\.experts': \['down_proj'\]\}"):
        moepage.unwrap(model)
    assert list(moepage.paged_layers(model))  # nothing was undone
    moepage.unwrap(model, discard_slot_edits=True)
    assert_same_state(model.state_dict(), original.state_dict())


def test_verify_catches_slots_that_differ_from_their_host_rows():
    """verify=True compares every resident slot with its host row after each step, so an edit
    no version counter sees (here: through the raw memory) is caught even by a step that pages
    nothing in."""
    from moepage.toy import ToyExperts

    experts = ToyExperts(E, 16, 8, 2)
    moepage.wrap(experts, K, verify=True)
    x, w = torch.randn(4, 16), torch.full((4, 2), 0.5)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]])  # experts 0..2: resident from the start
    experts(x, ids, w)
    layer = next(moepage.paged_layers(experts))
    layer.store.host_rows(layer.name, "gate_up_proj").numpy()[1] += 1.0  # numpy bumps no torch version counter
    with pytest.raises(moepage.VerifyError, match=r"slot 1 of 'gate_up_proj' differs from host row of expert 1"):
        experts(x, ids, w)


@pytest.mark.parametrize("copy_it", [copy.deepcopy, lambda m: torch.save(m, __import__("io").BytesIO())],
                         ids=["deepcopy", "torch.save"])
def test_copying_or_pickling_a_paged_model_is_refused_with_what_to_do(copy_it):
    model = small_model()
    moepage.wrap(model, K)
    with pytest.raises(moepage.ConfigError, match=r"cannot be pickled or copied .*state_dict\(\).*unwrap"):
        copy_it(model)
    moepage.unwrap(model)
    copy_it(model)  # an ordinary model again


def test_wrap_under_inference_mode_then_run_outside_it():
    """Host rows, slots and device state are ordinary tensors even when wrap runs under
    torch.inference_mode(): steps outside it page into them."""
    model = small_model()
    ref = copy.deepcopy(model)
    with torch.inference_mode():
        moepage.wrap(model, K)
    layer = next(moepage.paged_layers(model))
    assert not layer.store.slots(layer.name, "gate_up_proj").is_inference()
    assert not layer.store.host_rows(layer.name, "gate_up_proj").is_inference()
    assert all(torch.equal(a, b) for a, b in zip(run(model), run(ref)))
    with torch.inference_mode():
        assert all(torch.equal(a, b) for a, b in zip(run(model, seed=4), run(ref, seed=4)))


@pytest.mark.parametrize("kind", ["disk tier", "coded"])
def test_copied_entries_are_said_to_be_copies_once_per_model(tmp_path, kind):
    """Over a disk tier or coded rows a state_dict() entry is a copy, so an edit written into it in place is not kept:
    the first state_dict() says so, once per model, naming load_state_dict (which keeps it); a plain store's
    entries are the host rows themselves (edits followed), and it says nothing."""
    import warnings

    torch.manual_seed(0)
    model = ToyMoE(vocab=48, hidden=64, inter=32, layers=2, num_experts=E, top_k=2).to(torch.bfloat16).eval()
    ref = copy.deepcopy(model)
    options = dict(host_budget=4, spill_dir=tmp_path) if kind == "disk tier" else dict(compress=True)
    moepage.wrap(model, K, **options)
    with pytest.warns(UserWarning, match=r"state_dict\(\) entries .* are copies: an edit written into one in place "
                                         r"is not kept\. Write edits with model\.load_state_dict") as said:
        model.state_dict()["blocks.0.experts.down_proj"].neg_()
    assert len(said) == 1  # once, for every layer
    assert all(torch.equal(a, b) for a, b in zip(run(model), run(ref)))  # (the edit was not kept)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = model.state_dict()  # said once per model
        state["blocks.0.experts.down_proj"].neg_()
        model.load_state_dict(state)  # the way to keep it
    assert torch.equal(model.state_dict()["blocks.0.experts.down_proj"], state["blocks.0.experts.down_proj"])
    plain = small_model()
    moepage.wrap(plain, K)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.state_dict()
