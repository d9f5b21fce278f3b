"""moepage on Hugging Face transformers v5 MoE models: exactness of ``wrap`` and of the loader.

Every architecture is a tiny random model built from its Config class, saved with
``save_pretrained`` (safetensors) and reloaded; no hub access. Each test compares the paged model
with the unpaged one: prompt logits and greedy ``generate`` (tokens and every step's logits) must
be ``torch.equal``, in fp32 and bf16, under the "eager", "grouped_mm" and "batched_mm" experts
implementations, with K small enough that the prompt needs several waves.

Two CPU properties shape these tests (see docs/architectures.md, CPU fp32 notes):
- fp32 GEMV (an expert with one token) gives different bits for weights that are 16-byte aligned
  or not. ``AutoModelForCausalLM.from_pretrained`` leaves stacked safetensors tensors memory-mapped
  at file offsets (8-byte aligned), so the reference gets owned, aligned copies (``own``) like
  moepage's slots and loader.
- CPU elementwise kernels compute a vectorised body and a scalar tail (libm vs SLEEF, ~1 ulp), so an
  op on a *contiguous* ``[S, I]`` activation depends on a row's position when S*I is not a
  multiple of the vector step. gpt-oss's gate is contiguous: its tiny config uses I = 32, as every
  real MoE model's intermediate size is a multiple of 32.
"""

from __future__ import annotations

import os

import pytest
import safetensors  # noqa: F401  (the [test] extra installs it)
import torch
from transformers import AutoModelForCausalLM  # noqa: E402

import moepage  # noqa: E402
from helpers.hf import (  # noqa: E402
    ARCHS,
    DTYPES,
    FORMATS,
    IMPLS,
    assert_paged,
    assert_same,
    configs,
    make_checkpoints,
    reference,
    run,
)
from moepage.backends.torch import TorchStore  # noqa: E402
from moepage.integrations import transformers as mhf  # noqa: E402
from moepage.integrations.transformers import checkpoint as ckpt  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models, one thread


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(arch, fmt) -> (path, K)``: a tiny random model saved once per module."""
    return make_checkpoints(tmp_path_factory)


# -- wrap: every architecture, dtype and experts implementation ------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_wrap_exact(checkpoint, arch, dtype, impl):
    path, k = checkpoint(arch)
    model = reference(path, DTYPES[dtype], impl)
    ref = run(model)
    names = mhf.check_supported(model)
    moepage.wrap(model, resident=k)
    assert sorted(layer.name for layer in moepage.paged_layers(model)) == sorted(names)
    assert_same(ref, run(model))
    assert_paged(model, k)


@pytest.mark.parametrize("arch", ARCHS)
def test_wrap_exact_with_prefetch(checkpoint, arch):
    """prefetch=True finds every architecture's router beside its experts (moepage.prefetch);
    outputs stay exact and the prefetches page experts in."""
    path, k = checkpoint(arch)
    model = reference(path, torch.float32, "grouped_mm")
    ref = run(model)
    moepage.wrap(model, resident=k, prefetch=True)
    assert_same(ref, run(model))
    assert moepage.stats(model).total.prefetched > 0


def test_only_routed_experts_are_paged(checkpoint):
    """Shared experts and dense first layers stay ordinary modules."""
    path, k = checkpoint("deepseek_v3")
    model = reference(path, torch.float32, "eager")
    before = {n: p for n, p in model.named_parameters() if ".experts." not in n}
    moepage.wrap(model, resident=k)
    assert sorted(layer.name for layer in moepage.paged_layers(model)) == [
        "model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    after = dict(model.named_parameters())
    assert all(after[n] is p for n, p in before.items())  # shared experts, dense MLP, router: untouched
    assert not hasattr(model.model.layers[1].mlp.shared_experts, "_moepage")


# -- unsupported layouts ---------------------------------------------------------------------------
class _ExpertMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = torch.nn.Linear(8, 4, bias=False)
        self.up_proj = torch.nn.Linear(8, 4, bias=False)
        self.down_proj = torch.nn.Linear(4, 8, bias=False)


class _ListMoeBlock(torch.nn.Module):  # the layout of many trust_remote_code MoE models
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4, bias=False)
        self.experts = torch.nn.ModuleList(_ExpertMLP() for _ in range(4))


def test_modulelist_experts_are_refused_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _ListMoeBlock())
    for call in (mhf.check_supported, lambda m: moepage.wrap(m, resident=2)):
        with pytest.raises(moepage.ConfigError, match=r"_ListMoeBlock.*ModuleList of 4 _ExpertMLP"):
            call(model)


def test_no_moe_is_refused(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(moepage.ConfigError, match=r"LlamaForCausalLM .*not a Mixture-of-Experts"):
        moepage.wrap(model, resident=2)
    model.save_pretrained(tmp_path)
    with pytest.raises(moepage.ConfigError, match=r"not a Mixture-of-Experts"):
        mhf.from_pretrained(str(tmp_path), resident=2, device="cpu", progress=False)


def test_from_pretrained_on_cuda_without_cuda(checkpoint, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path, k = checkpoint("qwen3_moe")
    store = TorchStore()
    with pytest.raises(moepage.ConfigError, match=r"device='cuda': CUDA is not available here"):
        mhf.from_pretrained(path, resident=k, device="cuda", backend=store, progress=False)
    assert store.host_bytes() == 0 and not store._slots


def test_experts_without_routing_forward_are_refused():
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=16, intermediate_size_mlp=32,
                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1)
    with pytest.raises(moepage.ConfigError, match=r"Llama4TextExperts .*does not take the routing"):
        mhf.check_supported(Llama4ForCausalLM(config))


# -- the loader ------------------------------------------------------------------------------------
# gpt-oss checkpoints are stacked in both formats: one format case is enough there.
LOADER_CASES = [(a, f) for a in ARCHS for f in FORMATS if not (a == "gpt_oss" and f == "per_expert")]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch, fmt", LOADER_CASES)
def test_from_pretrained_exact(checkpoint, arch, fmt, dtype):
    path, k = checkpoint(arch, fmt)
    impl = "grouped_mm" if dtype == "fp32" else "eager"
    ref = run(reference(path, DTYPES[dtype], impl))
    model = mhf.from_pretrained(path, resident=k, device="cpu", dtype=DTYPES[dtype],
                                experts_implementation=impl, progress=False)
    assert model.config._experts_implementation == impl and not model.training
    assert all(not t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert_same(ref, run(model))
    assert_paged(model, k)


@pytest.mark.parametrize("arch, fmt", LOADER_CASES)
def test_from_pretrained_with_compressed_host_rows(checkpoint, arch, fmt, verify):
    """``compress=True`` through the loader: the checkpoint's rows are staged raw, coded layer by layer into the
    host store (smaller than raw, each decoding to the checkpoint's rows under ``verify``), and the model equals the
    unpaged one in bf16 (prompt logits, greedy generate); no staging rows are left."""
    path, k = checkpoint(arch, fmt)
    ref = run(reference(path, torch.bfloat16, "eager"))
    model = mhf.from_pretrained(path, resident=k, device="cpu", dtype=torch.bfloat16, experts_implementation="eager",
                                progress=False, compress=True, verify=verify)
    assert_same(ref, run(model))
    assert_paged(model, k)
    held = moepage.host_bytes(model)
    assert held and all(h.coded and h.held < h.raw for h in held.values())


@pytest.fixture(params=[False, True], ids=["plain", "verify"])
def verify(request):
    return request.param


def test_checkpoint_formats(checkpoint):
    """save_pretrained writes per-expert keys by default; save_original_format=False stacks them."""
    from safetensors import safe_open

    for fmt, pattern in (("per_expert", "mlp.experts.3.gate_proj.weight"), ("stacked", "mlp.experts.gate_up_proj")):
        path, _ = checkpoint("qwen3_moe", fmt)
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            assert any(key.endswith(pattern) for key in f.keys()), fmt


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_loader_never_builds_an_expert_stack(checkpoint, monkeypatch, fmt):
    """No tensor holding every expert of a layer exists outside the host store: stacked keys are
    read one expert row at a time, per-expert keys one expert at a time."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    path, k = checkpoint("mixtral", fmt)
    e = configs()["mixtral"][0].num_local_experts
    whole_reads = []
    real_open = safetensors.safe_open

    class Reader:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, key):
            return self.f.get_slice(key)

        def get_tensor(self, key):
            t = self.f.get_tensor(key)
            if t.dim() >= 1 and t.shape[0] == e and "experts" in key:
                whole_reads.append(key)
            return t

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.big = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and not t.is_meta}
            for t in tree_leaves(out):  # fresh storage only: views (of safetensors' mmap) allocate nothing
                if isinstance(t, torch.Tensor) and not t.is_meta and t.dim() == 3 and t.shape[0] == e:
                    if t.untyped_storage().data_ptr() not in inputs:
                        self.big.append((func, t.untyped_storage().data_ptr()))
            return out

    monkeypatch.setattr(safetensors, "safe_open", Reader)
    store = TorchStore()
    with Shapes() as shapes:
        model = mhf.from_pretrained(path, resident=k, device="cpu", backend=store, progress=False)
    host = {store.host_rows(layer.name, n).untyped_storage().data_ptr()
            for layer in moepage.paged_layers(model) for n in layer.specs}
    assert not whole_reads, f"read whole expert stacks: {whole_reads}"
    stray = [f for f, ptr in shapes.big if ptr not in host]
    assert not stray, f"E-row expert tensors built outside the host store by {stray}"
    assert len(host) == 2 * 2  # 2 layers x (gate_up_proj, down_proj)


def test_loader_failure_frees_everything(checkpoint, tmp_path, monkeypatch):
    import shutil

    from safetensors.torch import load_file, save_file

    path, k = checkpoint("qwen3_moe")
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    store = TorchStore()
    with pytest.raises(moepage.ConfigError, match=r"lacks routed expert weights: model\.layers\.1\.mlp\.experts"):
        mhf.from_pretrained(str(broken), resident=k, device="cpu", backend=store, progress=False)
    assert store.host_bytes() == 0 and not store._slots

    # A failure part-way through reading (an I/O error, say) also releases the store.
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise OSError("disk went away")
        return real(*args, **kwargs)

    real = ckpt.write_piece
    monkeypatch.setattr(ckpt, "write_piece", failing)
    store = TorchStore()
    with pytest.raises(OSError, match="disk went away"):
        mhf.from_pretrained(path, resident=k, device="cpu", backend=store, progress=False)
    assert store.host_bytes() == 0 and not store._slots


def test_truncated_checkpoint_is_named(checkpoint, tmp_path):
    """A cut-short file (an interrupted download) was a deserialisation error naming no file."""
    import shutil

    path, k = checkpoint("qwen3_moe")
    broken = tmp_path / "truncated"
    shutil.copytree(path, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    store = TorchStore()
    with pytest.raises(moepage.ConfigError, match=rf"{weights}: truncated or corrupt"):
        mhf.from_pretrained(str(broken), resident=k, device="cpu", backend=store, progress=False)
    assert store.host_bytes() == 0 and not store._slots


# -- saving a paged model ----------------------------------------------------------------------------
def _assert_same_parameters(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].shape == value.shape and torch.equal(got[name], value), name


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_save_pretrained_of_a_paged_model_reloads_equal(checkpoint, tmp_path, fmt):
    """save_pretrained writes all E expert rows (it wrote the K slot rows: a corrupt checkpoint)."""
    path, k = checkpoint("qwen3_moe")
    original = reference(path, torch.float32, "eager")
    want = {n: p.detach().clone() for n, p in original.named_parameters()}
    moepage.wrap(original, resident=k)
    run(original)  # page other experts in: the slots no longer hold experts 0..K-1
    original.save_pretrained(tmp_path / "saved", save_original_format=FORMATS[fmt])

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    _assert_same_parameters({n: p.detach() for n, p in reloaded.named_parameters()}, want)
    paged = mhf.from_pretrained(str(tmp_path / "saved"), resident=k, device="cpu", progress=False)
    moepage.unwrap(paged)
    _assert_same_parameters({n: p.detach() for n, p in paged.named_parameters()}, want)


def test_from_pretrained_runs_without_no_grad(checkpoint):
    """The loaded model requires no grad anywhere, so a plain ``model(ids)`` is inference."""
    path, k = checkpoint("qwen3_moe")
    model = mhf.from_pretrained(path, resident=k, device="cpu", progress=False)
    assert not any(p.requires_grad for p in model.parameters())
    ids = torch.randint(0, 96, (1, 12))
    with torch.enable_grad():
        logits = model(ids).logits
    assert logits.grad_fn is None
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


# -- CUDA (bf16) ------------------------------------------------------------------------------------




# -- refused before reading a weight ---------------------------------------------------------------
def refuse_weight_reads(monkeypatch) -> None:
    """Fail the test if the loader opens a safetensors file for its data from now on."""

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(safetensors, "safe_open", refuse)


@pytest.fixture
def no_weight_read(monkeypatch):
    refuse_weight_reads(monkeypatch)


def test_a_load_that_cannot_fit_host_memory_is_refused_first(checkpoint, monkeypatch):
    from moepage.planning import host

    path, k = checkpoint("qwen3_moe")
    reference_model = reference(path, torch.float32, "eager")  # read before reads are refused (alone, it is not cached)
    refuse_weight_reads(monkeypatch)
    monkeypatch.setattr(host, "host_memory_available", lambda: host.AvailableMemory(1000, "a test figure"))
    weights = sum(t.numel() * t.element_size() for t in (*reference_model.parameters(), *reference_model.buffers()))
    experts = sum(moepage.nn.find.row_bytes(m) for _, m in moepage.find_experts(reference_model))
    needed = weights + experts * k // configs()["qwen3_moe"][0].num_experts  # on the CPU: the slots too
    store = TorchStore()
    with pytest.raises(moepage.ConfigError) as info:
        mhf.from_pretrained(path, resident=k, device="cpu", backend=store, progress=False)
    message = str(info.value)
    assert message.startswith(f"{path}: a paged load needs ") and f"({needed} B) of host memory" in message
    assert "host_budget=" in message  # the disk tier is the way out
    assert "only 1000 B (1000 B) is available (a test figure)" in message
    assert store.host_bytes() == 0 and not store._slots


def test_options_and_environment_are_checked_before_the_checkpoint(checkpoint, monkeypatch):
    """A bad MOEPAGE_LOG_EVERY (or verify=) was reported only once the checkpoint had been read."""
    path, k = checkpoint("qwen3_moe")

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(ckpt, "checkpoint_files", refuse)
    monkeypatch.setenv("MOEPAGE_LOG_EVERY", "often")
    with pytest.raises(moepage.ConfigError, match=r"MOEPAGE_LOG_EVERY='often' is not a whole number >= 0"):
        mhf.from_pretrained(path, resident=k, device="cpu", progress=False)
    monkeypatch.delenv("MOEPAGE_LOG_EVERY")
    with pytest.raises(moepage.ConfigError, match=rf"cannot load {path}:\n  - verify='maybe' is not a flag"):
        mhf.from_pretrained(path, resident=k, device="cpu", progress=False, verify="maybe")
    with pytest.raises(moepage.ConfigError, match=r"dtype='int8': use a floating torch dtype .*'bf16', 'bfloat16'"):
        mhf.from_pretrained(path, resident=k, device="cpu", progress=False, dtype="int8")


@pytest.mark.parametrize("kwargs", [dict(resident=1000), dict(policy="sometimes"),
                                    dict(host_budget=1, spill_dir="rows")])
def test_errors_of_a_load_name_from_pretrained_not_wrap(checkpoint, tmp_path, monkeypatch, kwargs):
    """What wrap refuses inside from_pretrained names the call the user made."""
    path, k = checkpoint("qwen3_moe")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(moepage.ConfigError) as info:
        mhf.from_pretrained(path, **{"resident": k, **kwargs}, device="cpu", progress=False)
    assert str(info.value).startswith("moepage.integrations.transformers.from_pretrained: cannot ")
    assert "moepage.wrap" not in str(info.value)


@pytest.mark.parametrize("alias,dtype", [("bf16", torch.bfloat16), ("BFloat16", torch.bfloat16),
                                         ("fp16", torch.float16), ("float16", torch.float16),
                                         ("fp32", torch.float32), ("torch.float32", torch.float32),
                                         (torch.bfloat16, torch.bfloat16)])
def test_dtype_aliases(alias, dtype):
    from moepage.integrations.transformers.loader import _resolve_dtype

    assert _resolve_dtype(alias) is dtype


def test_from_pretrained_accepts_bf16(checkpoint):
    path, k = checkpoint("qwen3_moe")
    model = mhf.from_pretrained(path, resident=k, device="cpu", dtype="bf16", progress=False)
    assert model.model.embed_tokens.weight.dtype is torch.bfloat16


@pytest.mark.parametrize("text", ["{}", "not json {"])
def test_a_bad_index_file_is_named(checkpoint, tmp_path, text, no_weight_read):
    import shutil

    path, k = checkpoint("qwen3_moe")
    broken = tmp_path / "indexed"
    shutil.copytree(path, broken)
    (broken / "model.safetensors.index.json").write_text(text)
    with pytest.raises(moepage.ConfigError, match=rf"{broken / 'model.safetensors.index.json'}: not "):
        mhf.from_pretrained(str(broken), resident=k, device="cpu", progress=False)


@pytest.mark.parametrize("value", [None, "model"])
def test_check_supported_of_a_non_module(value):
    with pytest.raises(moepage.ConfigError, match=r"check_supported: module must be a torch.nn.Module"):
        mhf.check_supported(value)
