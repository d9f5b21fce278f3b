"""The architecture matrix: every MoE model type transformers ships (``helpers.hf_registry``, from
its own registries), paged and compared with the unpaged model by ``torch.equal``.

Per architecture, every experts implementation x dtype it runs (fp16 where the unpaged model
runs in it), with K cycling over {top_k, a middle K, E} and one user flow per case, cycling so
that each architecture goes through every flow:

- ``generate``: prompt logits, then greedy ``generate`` (tokens and every step's logits);
- ``padded``: a left-padded batch with its attention mask;
- ``device_planner``: the device planner on the CPU (steps of at most K entries planned there);
- ``capture_mode``: every step device-planned, as a CUDA-graph capture plans (multi-wave device steps);
- ``switch``: ``set_experts_implementation`` to another implementation after wrap;
- ``state_dict``: the paged model's state_dict loads into an unpaged one, and another model's
  state_dict into the paged one;
- ``inference_mode``: wrap under ``torch.inference_mode()``, run outside it;
- ``from_pretrained``: the model saved with ``save_pretrained`` (per-expert keys, what most hub
  checkpoints hold, through transformers' own conversion mapping) and loaded by moepage's loader.

What the unpaged model itself cannot run (an implementation transformers refuses for a class,
fp16 kernels CPU lacks) is skipped with transformers' own error as the reason. docs/architectures.md's
support table is generated from the same cases (``helpers.support``).
"""

from __future__ import annotations

import re

import pytest
import torch

import moepage
from helpers import support
from helpers.hf_registry import moe_archs
from helpers.matrix import assert_equal, outputs, unpaged

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("one_thread")]  # conftest
ARCHS = {a.model_type: a for a in moe_archs()}
CASES = support.matrix_cases(list(ARCHS.values()))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_paged_equals_unpaged(case: support.Case, tmp_path):
    arch = ARCHS[case.model_type]
    ref = unpaged(arch, case)
    model = unpaged(arch, case)
    k = case.resident(arch)
    if why := support.moepage_refusal(arch):  # refused by check_supported: wrap refuses it too, saying why
        with pytest.raises(moepage.ConfigError, match=re.escape(why)):
            moepage.wrap(model, resident=k)
        assert not list(moepage.paged_layers(model))
        return
    planner = dict(backend="torch", device_planner=True) if case.flow in ("device_planner", "capture_mode") else {}
    if case.flow == "switch":
        if not arch.dispatches:
            pytest.skip(f"{arch.experts_class} does not follow set_experts_implementation")
        moepage.wrap(model, resident=k)
        other = support.switch_target(case.impl)
        if support.unpaged_refusal(arch, other, case.dtype):
            pytest.skip(f"the unpaged model cannot run {other}")
        assert_equal(outputs(ref, arch, "padded"), outputs(model, arch, "padded"), f"{case}: before the switch")
        for m in (model, ref):
            m.set_experts_implementation(other)
    elif case.flow == "inference_mode":
        with torch.inference_mode():
            moepage.wrap(model, resident=k)
    elif case.flow == "from_pretrained":
        if not arch.causal_lm:
            pytest.skip(f"{arch.model_class.__name__} is no causal LM: from_pretrained builds AutoModelForCausalLM")
        from moepage.integrations import transformers as mhf

        ref.save_pretrained(tmp_path)
        # The reference is transformers' own loader (its dtype plan keeps some weights in fp32),
        # on owned, aligned storage as moepage's loader gives (CPU fp32 kernels see alignment).
        ref = arch.model_class.from_pretrained(tmp_path, dtype=case.dtype).eval()
        ref.requires_grad_(False)
        for p in ref.parameters():
            p.data = p.data.clone()
        if arch.dispatches:
            ref.set_experts_implementation(case.impl)
        model = mhf.from_pretrained(str(tmp_path), resident=k, device="cpu", dtype=case.dtype,
                                    experts_implementation=case.impl if arch.dispatches else None, progress=False)
    else:
        moepage.wrap(model, resident=k, **planner)
    with moepage.capture_mode(case.flow == "capture_mode"):
        got = outputs(model, arch, case.flow)
    assert_equal(outputs(ref, arch, case.flow), got, str(case))
    total = moepage.stats(model).total
    assert total.steps > 0
    if k < arch.num_experts:
        assert total.misses > 0, "the prompt should page experts in"
    if k == arch.top_k:
        assert total.waves > total.steps, "at K = top_k the prompt should need several waves"
    if case.flow == "state_dict":
        _round_trip(arch, case, model, ref)


def _round_trip(arch, case, paged, ref) -> None:
    """The paged model's state_dict is the unpaged model's; another model's loads into it."""
    fresh = unpaged(arch, case, seed=7)
    fresh.load_state_dict(paged.state_dict())
    assert_equal(outputs(ref, arch, "generate"), outputs(fresh, arch, "generate"), f"{case}: reloaded")
    other = unpaged(arch, case, seed=3)
    paged.load_state_dict(other.state_dict())
    assert_equal(outputs(other, arch, "generate"), outputs(paged, arch, "generate"), f"{case}: loaded into paged")


def test_every_moe_architecture_is_covered():
    """Every model type whose modeling code stacks experts is in the matrix, or skipped with its
    reason (multimodal wrappers of a covered text model, sub-configs without experts, ...)."""
    from helpers.hf_registry import skipped_archs

    assert len(ARCHS) >= 50  # transformers 5.19 ships 57 buildable ones
    for arch in ARCHS.values():
        flows = {c.flow for c in CASES if c.model_type == arch.model_type}
        assert flows == set(support.FLOWS), arch.model_type
        ks = {c.resident(arch) for c in CASES if c.model_type == arch.model_type}
        assert {arch.top_k, arch.num_experts} <= ks, arch.model_type
    assert all(reason for reason in skipped_archs().values())


def test_docs_support_table_is_current():
    """docs/architectures.md's support table is generated from the matrix's cases (``helpers.support``):
    regenerate it with ``python tests/helpers/support.py --write docs/architectures.md``."""
    import pathlib

    page = (pathlib.Path(__file__).parents[3] / "docs" / "architectures.md").read_text()
    assert support.table(list(ARCHS.values())) in page, (
        "docs/architectures.md's support table is stale: run python tests/helpers/support.py --write "
        "docs/architectures.md")


def test_gpt_oss_fp32_multi_wave_on_cpu():
    """gpt-oss's gate runs elementwise over the contiguous [S, I] activation, whose CPU kernels
    give a row's last bits by its place (vectorised body or scalar tail): per-entry waves on a
    subset of the rows were 1.4e-6 off. Waves now run in the unpaged shape."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(vocab_size=96, hidden_size=32, head_dim=8, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=32, num_experts_per_tok=4,
                          sliding_window=16, layer_types=["sliding_attention", "full_attention"], initializer_range=0.3,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None)
    for impl in ("grouped_mm", "batched_mm"):
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(config).eval()
        ref.set_experts_implementation(impl)
        ref.requires_grad_(False)
        for p in ref.parameters():
            p.data = p.data.clone()  # owned, aligned storage, as moepage's slots
        model = __import__("copy").deepcopy(ref)
        moepage.wrap(model, resident=16)
        ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits), impl
        assert moepage.stats(model).total.waves > moepage.stats(model).total.steps


# -- CUDA (the H200: bf16, CUDA kernels, captured decode) --------------------------------------------


