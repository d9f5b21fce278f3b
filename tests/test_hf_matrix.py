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
fp16 kernels CPU lacks) is skipped with transformers' own error as the reason. The README's
support table is generated from the same cases (``helpers.support``).
"""

from __future__ import annotations

import re

import pytest
import torch

import moepage
from helpers import support
from helpers.hf_registry import moe_archs

pytestmark = pytest.mark.filterwarnings("ignore")
ARCHS = {a.model_type: a for a in moe_archs()}
CASES = support.matrix_cases(list(ARCHS.values()))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _prompt(arch, batch: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, arch.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def _forward(model, arch, ids, mask=None) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if arch.causal_lm else out.last_hidden_state


def _outputs(model, arch, flow: str) -> list[torch.Tensor]:
    """What the flow compares: prompt outputs, and for causal LMs the greedy generation."""
    ids = _prompt(arch)
    mask = None
    if flow == "padded":
        ids[1, :5] = 0
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
    with torch.no_grad():
        outs = [_forward(model, arch, ids, mask)]
    if arch.causal_lm and flow in ("generate", "capture_mode", "inference_mode"):
        gen = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
        outs += [gen.sequences, *gen.logits]
    return outs


def _assert_equal(want: list[torch.Tensor], got: list[torch.Tensor], what: str) -> None:
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got)):
        assert a.shape == b.shape and torch.equal(a, b), (
            f"{what}: output {i} differs, max |d| = {(a.double() - b.double()).abs().max().item():.3g}")


def _unpaged(arch, case: support.Case, seed: int = 0):
    """The reference model, in the case's dtype and implementation; skips with transformers'
    own error where the unpaged model cannot run the case."""
    model = arch.build(seed).to(case.dtype)
    model.requires_grad_(False)
    why = support.unpaged_refusal(arch, case.impl, case.dtype)
    if why:
        pytest.skip(f"the unpaged model cannot run it: {why}")
    model.set_experts_implementation(case.impl) if arch.dispatches else None
    return model


@pytest.mark.parametrize("case", CASES, ids=str)
def test_paged_equals_unpaged(case: support.Case, tmp_path):
    arch = ARCHS[case.model_type]
    ref = _unpaged(arch, case)
    model = _unpaged(arch, case)
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
        _assert_equal(_outputs(ref, arch, "padded"), _outputs(model, arch, "padded"), f"{case}: before the switch")
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
        got = _outputs(model, arch, case.flow)
    _assert_equal(_outputs(ref, arch, case.flow), got, str(case))
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
    fresh = _unpaged(arch, case, seed=7)
    fresh.load_state_dict(paged.state_dict())
    _assert_equal(_outputs(ref, arch, "generate"), _outputs(fresh, arch, "generate"), f"{case}: reloaded")
    other = _unpaged(arch, case, seed=3)
    paged.load_state_dict(other.state_dict())
    _assert_equal(_outputs(other, arch, "generate"), _outputs(paged, arch, "generate"), f"{case}: loaded into paged")


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


def test_readme_support_table_is_current():
    """The README's support table is generated from the matrix's cases (``helpers.support``):
    regenerate it with ``python tests/helpers/support.py --write README.md``."""
    import pathlib

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    assert support.table(list(ARCHS.values())) in readme, (
        "README.md's support table is stale: run python tests/helpers/support.py --write README.md")


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
cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA_CASES = [(a.model_type, impl) for a in ARCHS.values() if not support.moepage_refusal(a) for impl in support.impls_of(a)]


@pytest.mark.parametrize("model_type, impl", CUDA_CASES, ids=["-".join(c) for c in CUDA_CASES])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_bf16_paged_equals_unpaged(model_type, impl, mark):
    """Every architecture of the matrix in bf16 on CUDA, whose kernels differ from the CPU's:
    prompt logits and greedy generate at K = top_k (the prompt needs several waves)."""
    arch = ARCHS[model_type]
    case = support.Case(model_type, impl, "bf16", "top_k", "generate")
    ref = _unpaged(arch, case).to("cuda")
    model = _unpaged(arch, case).to("cuda")
    moepage.wrap(model, resident=arch.top_k)
    _assert_equal(_outputs_on(ref, arch, "cuda"), _outputs_on(model, arch, "cuda"), str(case))
    total = moepage.stats(model).total
    assert total.misses > 0 and total.waves > total.steps


def _outputs_on(model, arch, device) -> list[torch.Tensor]:
    ids = _prompt(arch).to(device)
    with torch.no_grad():
        outs = [_forward(model, arch, ids)]
    if arch.causal_lm:
        gen = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
        outs += [gen.sequences, *gen.logits]
    return outs


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_gpt_oss_captured_decode_of_more_than_k_entries_between_eager_prefills(impl, mark):
    """gpt-oss (expert biases) in bf16: decode steps of 3 tokens x top-3 = 9 entries > K = 3 run as
    device-planned waves captured in one CUDA graph, replayed, then an eager (host-planned)
    prefill, then replays again: every step's logits equal the unpaged model's."""
    pytest.importorskip("cuda.bindings", reason="needs cuda-python (pip install 'moepage[cuda]')")
    from decode_loop import StaticDecode

    arch = ARCHS["gpt_oss"]
    case = support.Case("gpt_oss", impl, "bf16", "top_k", "generate")
    ref, model = (_unpaged(arch, case).to("cuda") for _ in range(2))
    for m in (ref, model):
        m.config._attn_implementation = "eager"  # no value-dependent mask shortcut: capturable
    moepage.wrap(model, resident=arch.top_k, backend="cuda")
    prompts = [[5, 9, 17, 33, 2, 8, 71, 40], list(range(3, 60, 4)), [11, 12, 13]]

    def rounds(m, captured: bool) -> list[torch.Tensor]:
        dec = StaticDecode(m, prompts, new_tokens=4)
        graph, out, seen = None, None, []
        for _ in range(2):  # eager prefill, then decode steps replayed from one graph
            token = dec.prefill().argmax(-1, keepdim=True)
            for i in range(4):
                dec.feed(i, token)
                if captured and graph is None:
                    with moepage.capture_mode():
                        dec.step()  # warm-up on the capture's path
                    graph = torch.cuda.CUDAGraph()
                    with moepage.capture_mode(), torch.cuda.graph(graph):
                        out = dec.step()
                    dec.feed(i, token)
                if captured:
                    graph.replay()
                    logits = out
                else:
                    logits = dec.step()
                seen.append(logits.float().clone())
                token = logits.argmax(-1, keepdim=True)
        return seen

    with torch.no_grad():
        got, want = rounds(model, True), rounds(ref, False)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    layer = next(moepage.paged_layers(model))
    assert int(layer.pager.device_state.counters[1]) > int(layer.pager.device_state.counters[0])  # several device waves per step
