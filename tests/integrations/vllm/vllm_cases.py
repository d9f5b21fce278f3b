"""moepage's vLLM plugin against the real vLLM 0.33.0 package, on the CPU. Run by ``test_vllm.py`` in a process of its
own with vLLM on the path (``helpers.vllm_site``); not collected by the main run (vLLM pins another torch and
patches what it imports). vLLM's own code runs throughout: its plugin loader, argument parser and engine config, its
model classes and weight loader, its MoE runner, router and modular kernel (prepare, finalize, workspaces); only the
expert GEMMs are a torch stand-in (``vllm_double``: the CUDA wheel has no CPU kernel)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402
import vllm_double  # noqa: E402
import vllm_layers  # noqa: E402
from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs  # noqa: E402

from moepage.bits import same_bits  # noqa: E402
from moepage.errors import ConfigError  # noqa: E402
from moepage.integrations.vllm import checks, settings  # noqa: E402

vllm_double.install()
E, TOP_K, HIDDEN, INTER = 8, 2, 64, 32


@pytest.fixture(scope="session", autouse=True)
def distributed():
    """vLLM's plugins (as every vLLM process loads them: moepage's by its entry point alone) and its process groups
    (one CPU rank), as its workers set them up; so any case runs on its own."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mkstemp()[1]}")
        initialize_model_parallel(1, 1)
    yield


# -- the plugin, its flags and its startup checks --------------------------------------------------------------
def test_vllm_loads_the_plugin_from_its_entry_point():
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # VLLM_PLUGINS=moepage: vLLM finds it by the entry point alone (again: the fixture did)
    for owner, attr in ((EngineArgs, "add_cli_args"), (EngineArgs, "from_cli_args"),
                        (EngineArgs, "create_engine_config"), (RoutedExperts, "_get_quant_method"),
                        (BaseModelLoader, "load_model")):
        assert getattr(getattr(owner, attr), "__moepage_wrapped__", False), attr
    from moepage.integrations.vllm import register

    before = {a: EngineArgs.__dict__[a] for a in ("add_cli_args", "from_cli_args")}
    register()  # vLLM may call it again in the same process: nothing wrapped twice
    assert {a: EngineArgs.__dict__[a] for a in before} == before


def _parser():
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from moepage.integrations.vllm import register

    register()
    return make_arg_parser(FlexibleArgumentParser())


def test_serve_flags_travel_in_additional_config():
    args = _parser().parse_args(["some/model", "--paged-experts-num-resident", "4", "--paged-experts-policy", "lru",
                                 "--paged-experts-compress", "--additional-config", '{"other": 1}'])
    args.model = args.model_tag
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert engine_args.additional_config == {"other": 1, "moepage": {"num_resident": 4, "policy": "lru",
                                                                     "compress": True}}
    plain = _parser().parse_args(["some/model"])
    plain.model = plain.model_tag
    assert "moepage" not in (AsyncEngineArgs.from_cli_args(plain).additional_config or {})


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_serve_refuses_a_bad_resident_count_when_parsing(value, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["some/model", "--paged-experts-num-resident", value])
    assert "--paged-experts-num-resident" in capsys.readouterr().err


def test_serve_help_lists_moepages_flags(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for option in settings.OPTIONS.values():
        assert option.flag in out


@pytest.mark.parametrize("field", [f for f, _, _ in checks.REFUSED_LAUNCH])
def test_every_refused_launch_says_why_and_what_to_do(field):
    value = 2 if isinstance(getattr(checks.Launch(), field), int) and not isinstance(
        getattr(checks.Launch(), field), bool) else (True if field != "offload" else "--cpu-offload-gb")
    launch = checks.Launch(**{field: value})
    with pytest.raises(ConfigError) as err:
        checks.check(launch, {"num_resident": 4})
    why, fix = next((w, f) for f_, w, f in checks.REFUSED_LAUNCH if f_ == field)
    assert why in str(err.value) and fix in str(err.value)
    checks.check(checks.Launch(), {"num_resident": 4})  # the default launch is served


def _tiny_checkpoint(root: Path, kind: str, dtype: torch.dtype) -> Path:
    """A tiny random checkpoint of transformers' own model class, saved as safetensors."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=TOP_K, max_position_embeddings=512)
    if kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=INTER,
                                                   head_dim=16, num_experts=E))
    else:
        model = MixtralForCausalLM(MixtralConfig(**common, intermediate_size=INTER, num_local_experts=E))
    path = root / kind
    model.to(dtype).save_pretrained(path)
    return path


def test_a_launch_vllm_refuses_for_paging_fails_before_any_engine_starts(tmp_path):
    path = _tiny_checkpoint(tmp_path, "mixtral", torch.bfloat16)
    chosen = {"num_resident": 2, "prefetch": "sometimes", "host_budget": 4, "spill_dir": str(tmp_path / "rows")}
    args = EngineArgs(model=str(path), skip_tokenizer_init=True, load_format="dummy", enforce_eager=True,
                      additional_config={"moepage": chosen})
    with pytest.raises(ConfigError) as err:
        args.create_engine_config()
    text = str(err.value)
    assert "--load-format dummy with a disk tier (--paged-experts-host-budget)" in text  # every reason, at once
    assert "--paged-experts-prefetch" in text and text.count("\n  - ") == 2, text
    EngineArgs(model=str(path), skip_tokenizer_init=True, load_format="dummy").create_engine_config()  # unpaged
    EngineArgs(model=str(path), skip_tokenizer_init=True, load_format="dummy",  # dummy weights paged: served
               additional_config={"moepage": {"num_resident": 2}}).create_engine_config()


@pytest.mark.parametrize("chosen, says", [
    ({"num_resident": "auto"}, "auto sizes K from the checkpoint's safetensors headers"),  # Launch(): no files
    ({"num_resident": 0}, "expected a positive integer"),
    ({"num_resident": 4, "policy": "fifo"}, "--paged-experts-policy"),
    ({"num_resident": 4, "colour": "red"}, "unknown option(s) 'colour'"),
])
def test_bad_options_are_refused_naming_the_option(chosen, says):
    with pytest.raises(ConfigError, match=None) as err:
        checks.check(checks.Launch(), settings.options({"moepage": chosen}))
    assert says in str(err.value)


# -- one layer, built by vLLM's factory -------------------------------------------------------------------------

def _checkpoint(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER)))
    return {f"{e}.{name}.weight": (torch.randn(shape, generator=gen) * 0.1).to(dtype) for e in range(E)
            for name, shape in shapes}


def _layer(chosen: dict | None, dtype: torch.dtype, checkpoint: dict, prefix: str | None = None):
    """A MoE runner as vLLM's factory builds it under moepage's options ``chosen``, loaded; (runner, config)."""
    return vllm_layers.build(chosen, checkpoint, device="cpu", prefix=prefix, num_experts=E, top_k=TOP_K,
                             hidden_size=HIDDEN, intermediate_size=INTER, params_dtype=dtype)


_step = vllm_layers.step


def _logits(tokens: int, distinct: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Router logits whose top-2 picks cover ``distinct`` experts (waves = ceil(distinct / K) on the host)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E, generator=gen) * 0.01
    for t in range(tokens):
        a, b = (2 * t) % distinct, (2 * t + 1) % distinct
        logits[t, a] += 4.0
        logits[t, b] += 3.0 + 0.5 * t / tokens
    return logits.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_host_rows_hold_what_vllms_loader_writes(dtype):
    checkpoint = _checkpoint(dtype)
    plain, _ = _layer(None, dtype, checkpoint)
    paged, _ = _layer({"num_resident": 3}, dtype, checkpoint)
    method = paged.routed_experts.quant_method
    assert type(method).__name__ == "PagedVllmMethod"
    for name in ("w13_weight", "w2_weight"):
        assert getattr(paged.routed_experts, name).shape[0] == 3  # the slot table
        assert same_bits(method.rows.store.host_rows(method.layer_key, name), getattr(plain.routed_experts, name).data)


@pytest.mark.parametrize("planner", ["host", "device"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [TOP_K, 3, E])
def test_paged_steps_equal_unpaged_in_one_two_and_many_waves(k, dtype, planner, monkeypatch):
    monkeypatch.setenv("MOEPAGE_DEVICE_PLANNER", "1" if planner == "device" else "0")
    checkpoint = _checkpoint(dtype, seed=k)
    plain, plain_config = _layer(None, dtype, checkpoint)
    paged, paged_config = _layer({"num_resident": k}, dtype, checkpoint)
    pager = paged.routed_experts.quant_method.pager
    assert (pager.device_state is not None) == (planner == "device")
    gen = torch.Generator().manual_seed(1)
    waves_seen = set()
    for tokens, distinct in ((1, 2), (2, 4), (3, 6), (8, 8), (5, 8), (1, 2)):
        x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
        logits = _logits(tokens, distinct, dtype, seed=tokens * 10 + distinct)
        before = pager.counts.waves
        calls = vllm_double.TorchTritonExperts.calls
        got = _step(paged, paged_config, x, logits)
        waves = vllm_double.TorchTritonExperts.calls - calls  # the kernel runs once a wave
        assert same_bits(got, _step(plain, plain_config, x, logits)), (tokens, distinct)
        if planner == "host":
            assert pager.counts.waves - before == waves
        waves_seen.add(waves)
    assert max(waves_seen) == -(-E // k) and min(waves_seen) == 1
    if k < E:
        assert len(waves_seen) >= 2


# -- block FP8 (vLLM's own Fp8MoEMethod: FP8 weights, per-block scales, activations quantized per token group) -------
FP8_H, FP8_I = 256, 256  # whole 128 x 128 blocks


def _fp8_checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """Per expert: FP8 weights and their per-block inverse scales, as a block-FP8 checkpoint holds them."""
    gen = torch.Generator().manual_seed(seed)
    shapes = (("gate_proj", (FP8_I, FP8_H)), ("up_proj", (FP8_I, FP8_H)), ("down_proj", (FP8_H, FP8_I)))
    out = {}
    for e in range(E):
        for name, shape in shapes:
            out[f"{e}.{name}.weight"] = torch.randn(shape, generator=gen).to(torch.float8_e4m3fn)
            out[f"{e}.{name}.weight_scale_inv"] = torch.rand((shape[0] // 128, shape[1] // 128), generator=gen) * 0.01
    return out


def _fp8_layer(chosen: dict | None, dtype: torch.dtype, checkpoint: dict, block: bool = True,
               scheme: str = "dynamic"):
    """A MoE runner with vLLM's FP8 method (block-quantized unless ``block`` is False), loaded; (runner, config)."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    quant = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme=scheme,
                      weight_block_size=[128, 128] if block else None)
    return vllm_layers.build(chosen, checkpoint, device="cpu", num_experts=E, top_k=TOP_K, hidden_size=FP8_H,
                             intermediate_size=FP8_I, params_dtype=dtype, quant_config=quant)


@pytest.mark.parametrize("planner", ["host", "device"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [TOP_K, 3, E])
def test_block_fp8_steps_equal_unpaged_in_one_two_and_many_waves(k, dtype, planner, monkeypatch):
    """The slots hold each expert's FP8 rows and its own block scales: the kernel reads both from the slot table."""
    monkeypatch.setenv("MOEPAGE_DEVICE_PLANNER", "1" if planner == "device" else "0")
    checkpoint = _fp8_checkpoint(seed=k)
    plain, plain_config = _fp8_layer(None, dtype, checkpoint)
    paged, paged_config = _fp8_layer({"num_resident": k}, dtype, checkpoint)
    method = paged.routed_experts.quant_method
    assert type(method).__name__ == "PagedVllmMethod" and "Fp8MoEMethod" in type(method.base_method).__name__
    scales = {"w13_weight_scale_inv", "w2_weight_scale_inv"}
    assert scales <= set(method.names)  # paged beside the weights
    for name in method.names:
        assert getattr(paged.routed_experts, name).shape[0] == k
        assert same_bits(method.rows.store.host_rows(method.layer_key, name), getattr(plain.routed_experts, name).data)
    waves_seen = set()
    for tokens, distinct in ((1, 2), (3, 6), (8, 8), (5, 8), (1, 2)):
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, FP8_H, generator=gen).to(dtype)
        logits = _logits(tokens, distinct, dtype, seed=tokens * 10 + distinct)
        calls = vllm_double.TorchTritonExperts.calls
        got = _step(paged, paged_config, x, logits)
        waves_seen.add(vllm_double.TorchTritonExperts.calls - calls)
        assert same_bits(got, _step(plain, plain_config, x, logits)), (tokens, distinct)
    assert max(waves_seen) == -(-E // k) and min(waves_seen) == 1


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_per_tensor_fp8_is_refused_naming_the_layer_and_why(scheme):
    """Per-tensor FP8 scales its activations over the whole batch (dynamic) or by one scale over all experts
    (static): refused before the layer's tensors exist."""
    with pytest.raises(ConfigError) as err:
        _fp8_layer({"num_resident": 3}, torch.bfloat16, {}, block=False, scheme=scheme)
    assert f"FP8 experts with per-tensor {scheme} scales" in str(err.value) and "model.layers." in str(err.value)


def test_compressing_fp8_rows_is_refused():
    with pytest.raises(ConfigError, match="--paged-experts-compress: the experts are torch.float8_e4m3fn"):
        _fp8_layer({"num_resident": 3, "compress": True}, torch.bfloat16, {})


def test_an_fp8_launch_is_served_and_other_quantizations_are_refused():
    checks.check(checks.Launch(quantization="fp8"), {"num_resident": 4})
    with pytest.raises(ConfigError, match="quantization 'awq_marlin': moepage's vLLM plugin serves unquantized and "
                                          "block-FP8"):
        checks.check(checks.Launch(quantization="awq_marlin"), {"num_resident": 4})


def test_stats_report_the_layers_steps():
    from moepage.integrations.vllm import stats

    checkpoint = _checkpoint(torch.bfloat16)
    paged, config = _layer({"num_resident": 2}, torch.bfloat16, checkpoint)
    _step(paged, config, torch.randn(4, HIDDEN).to(torch.bfloat16), _logits(4, 8, torch.bfloat16, seed=3))
    (name, layer), = stats(paged).items()
    assert layer.steps == 1 and layer.waves == 4 and layer.misses >= 6 and layer.num_slots == 2


def test_compressed_rows_page_exactly():
    checkpoint = _checkpoint(torch.bfloat16)
    plain, plain_config = _layer(None, torch.bfloat16, checkpoint)
    paged, paged_config = _layer({"num_resident": 2, "compress": True}, torch.bfloat16, checkpoint)
    method = paged.routed_experts.quant_method
    held = method.rows.store.layer_bytes(method.layer_key)
    assert held.held < held.raw
    for tokens in (1, 6):
        x = torch.randn(tokens, HIDDEN).to(torch.bfloat16)
        logits = _logits(tokens, 8, torch.bfloat16, seed=tokens)
        assert same_bits(_step(paged, paged_config, x, logits), _step(plain, plain_config, x, logits))


def test_a_layer_outside_the_k_rule_is_refused_before_its_tensors_exist():
    with pytest.raises(ConfigError) as err:
        _layer({"num_resident": E + 1}, torch.bfloat16, _checkpoint(torch.bfloat16))
    assert f"num_experts={E}" in str(err.value) and "mlp.experts" in str(err.value)
    with pytest.raises(ConfigError, match="below top_k"):
        _layer({"num_resident": 1}, torch.bfloat16, _checkpoint(torch.bfloat16))


def test_a_split_file_gives_each_layer_its_k(tmp_path):
    split = tmp_path / "split.json"
    first, second = "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"
    split.write_text(json.dumps({"layers": {first: 2, second: 6}, "budget": 8}))  # 4 a layer: as the file has it
    checkpoint = _checkpoint(torch.bfloat16)
    a, _ = _layer({"num_resident": 4, "split": str(split)}, torch.bfloat16, checkpoint, prefix=first)
    b, _ = _layer({"num_resident": 4, "split": str(split)}, torch.bfloat16, checkpoint, prefix=second)
    assert (a.routed_experts.w13_weight.shape[0], b.routed_experts.w13_weight.shape[0]) == (2, 6)


# -- whole models: vLLM's model classes and checkpoint loader ---------------------------------------------------
def _model(path: Path, chosen: dict | None, dtype: str):
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    extra = {"moepage": chosen} if chosen else {}
    config = EngineArgs(model=str(path), skip_tokenizer_init=True, enforce_eager=True, dtype=dtype,
                        additional_config=extra).create_engine_config()
    with set_current_vllm_config(config):
        with torch.device("cpu"):
            model = initialize_model(vllm_config=config)
        get_model_loader(config.load_config).load_weights(model, config.model_config)
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    return model, config


@pytest.mark.parametrize("kind, dtype", [("qwen3_moe", "float32"), ("mixtral", "bfloat16")])
def test_a_checkpoint_vllm_loads_is_paged_exactly_in_every_moe_layer(kind, dtype, tmp_path):
    """vLLM's own model class and loader (checkpoint names, w1/w3 placement) fill the host rows; every MoE layer
    then steps as the unpaged model's. (Qwen3-MoE in float32: vLLM's CPU router GEMM takes no bf16 input.)"""
    path = _tiny_checkpoint(tmp_path, kind, getattr(torch, dtype))
    plain, plain_config = _model(path, None, dtype)
    paged, paged_config = _model(path, {"num_resident": 3}, dtype)
    runners = [(n, m) for n, m in plain.named_modules() if type(m).__name__ == "MoERunner"]
    paged_runners = dict(paged.named_modules())
    assert len(runners) == 2
    for name, runner in runners:
        twin = paged_runners[name]
        method = twin.routed_experts.quant_method
        assert type(method).__name__ == "PagedVllmMethod"
        for tensor in ("w13_weight", "w2_weight"):
            assert same_bits(method.rows.store.host_rows(method.layer_key, tensor),
                             getattr(runner.routed_experts, tensor).data)
        gate = dict(plain.named_modules())[name.rsplit(".experts", 1)[0] + ".gate"]
        for tokens in (1, 4, 17):
            x = torch.randn(tokens, HIDDEN).to(getattr(torch, dtype))
            # Qwen3-MoE's runner holds its gate (it takes the hidden states); Mixtral's takes the logits.
            holds_gate = getattr(runner, "gate", None) is not None
            logits = x if holds_gate else torch.nn.functional.linear(x.float(), gate.weight.float())
            assert same_bits(_step(twin, paged_config, x, logits), _step(runner, plain_config, x, logits))
        assert method.pager.counts.waves > 3


def _fp8_mixtral_checkpoint(root: Path) -> Path:
    """A tiny Mixtral checkpoint with block-FP8 experts (weights and ``weight_scale_inv`` per 128 x 128 block, as
    FP8 checkpoints ship them) and bf16 attention (listed in ``ignored_layers``)."""
    from safetensors.torch import load_file, save_file
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    layers = 2
    config = MixtralConfig(vocab_size=256, hidden_size=FP8_H, intermediate_size=FP8_I, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=E,
                           num_experts_per_tok=TOP_K, max_position_embeddings=512)
    path = root / "mixtral_fp8"
    MixtralForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    fmax = torch.finfo(torch.float8_e4m3fn).max
    for name in [n for n in tensors if ".experts." in n and n.endswith(".weight")]:
        w = tensors[name].float()
        blocks = w.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))  # [rows/128, 128, cols/128, 128]
        scale = blocks.abs().amax((1, 3)) / fmax
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        tensors[name] = q.flatten(2).flatten(0, 1).contiguous()
        tensors[name + "_scale_inv"] = scale.contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    hf = json.loads((path / "config.json").read_text())
    attention = [f"model.layers.{i}.self_attn.{p}" for i in range(layers)
                 for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    hf["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                                 "ignored_layers": [*attention, "lm_head"]}
    (path / "config.json").write_text(json.dumps(hf))
    return path


def test_a_block_fp8_checkpoint_vllm_loads_is_paged_exactly():
    """vLLM's own Mixtral class and loader map the checkpoint's FP8 expert weights and their block scales into the
    host rows; every MoE layer then steps as the unpaged model's."""
    with tempfile.TemporaryDirectory() as root:
        path = _fp8_mixtral_checkpoint(Path(root))
        plain, plain_config = _model(path, None, "bfloat16")
        paged, paged_config = _model(path, {"num_resident": 3}, "bfloat16")
    runners = [(n, m) for n, m in plain.named_modules() if type(m).__name__ == "MoERunner"]
    twins = dict(paged.named_modules())
    assert len(runners) == 2
    for name, runner in runners:
        method = twins[name].routed_experts.quant_method
        assert type(method).__name__ == "PagedVllmMethod" and type(method.base_method).__name__ == "Fp8MoEMethod"
        for tensor in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"):
            rows = method.rows.store.host_rows(method.layer_key, tensor)
            assert same_bits(rows, getattr(runner.routed_experts, tensor).data), tensor
        gate = dict(plain.named_modules())[name.rsplit(".experts", 1)[0] + ".gate"]
        for tokens in (1, 4, 17):
            x = torch.randn(tokens, FP8_H).to(torch.bfloat16)
            logits = torch.nn.functional.linear(x.float(), gate.weight.float())
            assert same_bits(_step(twins[name], paged_config, x, logits), _step(runner, plain_config, x, logits))
        assert method.pager.counts.waves > 3


def _loaded_model(path: Path, chosen: dict | None, dtype: str, load_format: str = "auto"):
    """The model as vLLM's own loader returns it (``BaseModelLoader.load_model``: where the plugin links prefetch)."""
    from vllm.model_executor.model_loader import get_model_loader

    config = EngineArgs(model=str(path), skip_tokenizer_init=True, enforce_eager=True, dtype=dtype,
                        load_format=load_format,
                        additional_config={"moepage": chosen} if chosen else {}).create_engine_config()
    with set_current_vllm_config(config):
        model = get_model_loader(config.load_config).load_model(vllm_config=config, model_config=config.model_config)
    return model, config


@pytest.mark.parametrize("kind, dtype, setting", [("qwen3_moe", "float32", "on"), ("mixtral", "bfloat16", 2)])
def test_next_layer_prefetch_pages_the_next_layers_experts_and_stays_exact(kind, dtype, setting, tmp_path):
    """With prefetch on, vLLM's loader returns a model whose paged layers are linked in order (layer 0 predicts layer
    1's experts with layer 1's gate: the runner's own in Qwen3-MoE, the block's in Mixtral); stepping the layers in
    order prefetches into the next, and every step equals unpaged. A load past vLLM's loader is refused at the step."""
    path = _tiny_checkpoint(tmp_path, kind, getattr(torch, dtype))
    plain, plain_config = _model(path, None, dtype)
    paged, paged_config = _loaded_model(path, {"num_resident": 3, "prefetch": setting}, dtype)
    runners = [(n, m) for n, m in plain.named_modules() if type(m).__name__ == "MoERunner"]
    twins = dict(paged.named_modules())
    methods = [twins[n].routed_experts.quant_method for n, _ in runners]
    assert methods[0].link.target is methods[1].pager and methods[1].link is None
    assert methods[0].link.predictor.top == (TOP_K if setting == "on" else setting)
    gen = torch.Generator().manual_seed(3)

    def logits_for(name, runner, x):  # Qwen3-MoE's runner holds its gate (it takes x); Mixtral's takes the logits
        if getattr(runner, "gate", None) is not None:
            return x
        gate = dict(plain.named_modules())[name.rsplit(".experts", 1)[0] + ".gate"]
        return torch.nn.functional.linear(x.float(), gate.weight.float())

    for tokens in (1, 4, 17):
        x = torch.randn(tokens, HIDDEN, generator=gen).to(getattr(torch, dtype))
        for name, runner in runners:  # in layer order: each layer prefetches into the next
            logits = logits_for(name, runner, x)
            assert same_bits(_step(twins[name], paged_config, x, logits), _step(runner, plain_config, x, logits))
    assert methods[1].pager.read_stats().prefetched > 0 and methods[0].pager.read_stats().prefetched == 0
    unlinked, config = _model(path, {"num_resident": 3, "prefetch": setting}, dtype)
    name, runner = runners[0]
    with pytest.raises(ConfigError, match="prefetch is on but the layers were never linked"):
        _step(dict(unlinked.named_modules())[name], config, x, logits_for(name, runner, x))

# -- dummy weights (--load-format dummy): vLLM's DummyModelLoader ---------------------------------------------------
def _same_rows(method, plain_experts) -> None:
    """Every host row of ``method`` (read back: coded or not) as the unpaged layer's tensor holds it."""
    for n in method.names:
        want = getattr(plain_experts, n).data
        assert want.float().abs().max() > 0, n
        for e in range(E):
            assert same_bits(method.rows.store.read_row(method.layer_key, n, e), want[e]), (n, e)


@pytest.mark.parametrize("dtype, chosen, fp8", [
    (torch.bfloat16, {"num_resident": 3}, False), (torch.float16, {"num_resident": TOP_K}, False),
    (torch.bfloat16, {"num_resident": 3, "compress": True}, False), (torch.bfloat16, {"num_resident": 3}, True)])
def test_dummy_weights_fill_the_host_rows_as_the_unpaged_tensors(dtype, chosen, fp8):
    """vLLM's ``DummyModelLoader`` fills every tensor of the layer (the paged one's K-row slot table too) with no
    loader run; at post-load the host rows hold what it put in the unpaged layer's [E, ...] tensors, bit for bit
    (coded too; block FP8: its FP8 rows from a float16 detour over a wider range, and its float32 block scales), and
    steps of one, two and many waves equal unpaged."""
    quant = {}
    if fp8:
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config

        quant = {"quant_config": Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                                           weight_block_size=[128, 128])}
    width, inter = (FP8_H, FP8_I) if fp8 else (HIDDEN, INTER)
    shape = dict(device="cpu", num_experts=E, top_k=TOP_K, hidden_size=width, intermediate_size=inter,
                 params_dtype=dtype, dummy=True, **quant)
    plain, plain_config = vllm_layers.build(None, {}, **shape)
    paged, paged_config = vllm_layers.build(chosen, {}, **shape)
    method = paged.routed_experts.quant_method
    assert type(method).__name__ == "PagedVllmMethod" and method.config.compress == bool(chosen.get("compress"))
    assert ({"w13_weight_scale_inv", "w2_weight_scale_inv"} <= set(method.names)) == fp8
    _same_rows(method, plain.routed_experts)
    gen = torch.Generator().manual_seed(2)
    for tokens, distinct in ((1, 2), (3, 6), (8, 8)):
        x = (torch.randn(tokens, width, generator=gen) * 100).to(dtype)
        logits = _logits(tokens, distinct, dtype, seed=tokens)
        got = _step(paged, paged_config, x, logits)
        assert got.abs().max() > 0 and same_bits(got, _step(plain, plain_config, x, logits)), tokens
    assert method.pager.counts.waves >= 1 + -(-E // chosen["num_resident"])


@pytest.mark.parametrize("kind, setting", [("qwen3_moe", None), ("mixtral", "on")])
def test_a_dummy_model_vllm_loads_is_paged_exactly(kind, setting, tmp_path):
    """``--load-format dummy`` through vLLM's own model class and ``DummyModelLoader.load_model`` (float32: vLLM's CPU
    router GEMM): every MoE layer's host rows hold the unpaged model's dummy values and its steps equal unpaged; with
    prefetch on, the loader's hook links the layers."""
    path = _tiny_checkpoint(tmp_path, kind, torch.float32)
    chosen = {"num_resident": 3, **({"prefetch": setting} if setting else {})}
    plain, plain_config = _loaded_model(path, None, "float32", "dummy")
    paged, paged_config = _loaded_model(path, chosen, "float32", "dummy")
    twins = dict(paged.named_modules())
    runners = [(n, m) for n, m in plain.named_modules() if type(m).__name__ == "MoERunner"]
    methods = [twins[n].routed_experts.quant_method for n, _ in runners]
    assert len(runners) == 2 and all(type(m).__name__ == "PagedVllmMethod" for m in methods)
    gen = torch.Generator().manual_seed(4)
    for tokens in (1, 4, 17):
        x = torch.randn(tokens, HIDDEN, generator=gen) * 100
        for name, runner in runners:  # in layer order: each layer prefetches into the next
            logits = x if getattr(runner, "gate", None) is not None else _logits(tokens, 8, x.dtype, tokens)
            got = _step(twins[name], paged_config, x, logits)
            assert got.abs().max() > 0 and same_bits(got, _step(runner, plain_config, x, logits)), (name, tokens)
    for (_, runner), method in zip(runners, methods):
        _same_rows(method, runner.routed_experts)
        assert method.pager.counts.waves > 3
    assert methods[0].prefetch_linked == bool(setting)
    if setting:
        assert methods[0].link.target is methods[1].pager and methods[1].pager.read_stats().prefetched > 0


# -- breadth: every MoE architecture transformers and vLLM both have --------------------------------------------
def _shared_architectures() -> list:
    """transformers' MoE model types (``helpers.hf_registry``, from its own registries) whose model class vLLM's
    registry serves."""
    from vllm import ModelRegistry

    from helpers import hf_registry

    served = set(ModelRegistry.get_supported_archs())
    return [a for a in hf_registry.moe_archs() if a.model_class.__name__ in served]


_SHARED = _shared_architectures()
_EXACT: set[str] = set()  # the model types paged exactly in every MoE layer (the case below fills it)


def _save(arch, root: Path) -> Path:
    model = arch.build()
    model.config.architectures = [arch.model_class.__name__]
    path = root / arch.model_type
    model.to(torch.float32).save_pretrained(path)
    return path


def _loaded(path: Path, chosen: dict | None):
    """The model vLLM builds and loads from ``path`` (float32: vLLM's CPU router GEMM), or the exception it raised."""
    try:
        return _model(path, chosen, "float32")
    except Exception as exc:  # noqa: BLE001 - compared below, paged against unpaged
        return exc


def test_vllm_and_transformers_share_moe_architectures():
    assert len(_SHARED) >= 20, [a.model_type for a in _SHARED]  # a registry change that drops most shows here


@pytest.mark.parametrize("arch", _SHARED, ids=[a.model_type for a in _SHARED])
def test_every_shared_architecture_is_paged_exactly_or_refused_at_startup(arch, tmp_path):
    """Each model type both frameworks have: built and loaded by vLLM with paging, every MoE layer's host rows equal
    the unpaged model's and its steps equal in several waves. A model vLLM itself cannot build or run on the CPU
    fails the same way paged (moepage adds no failure); one moepage refuses is refused at startup, by name."""
    path = _save(arch, tmp_path)
    k = max(arch.top_k, min(arch.num_experts, arch.top_k + 1))
    refused = checks.REFUSED_ARCHITECTURES.get(arch.model_class.__name__)
    if refused:
        with pytest.raises(ConfigError, match=arch.model_class.__name__):
            _model(path, {"num_resident": k}, "float32")
        return
    plain = _loaded(path, None)
    if isinstance(plain, Exception):  # vLLM's own limit on the CPU
        paged = _loaded(path, {"num_resident": k})
        assert isinstance(paged, Exception) and (type(paged), str(paged)) == (type(plain), str(plain)), paged
        return
    (plain_model, plain_config), (paged_model, paged_config) = plain, _model(path, {"num_resident": k}, "float32")
    twins = dict(paged_model.named_modules())
    runners = [(n, m) for n, m in plain_model.named_modules() if type(m).__name__ == "MoERunner"]
    assert runners
    for name, runner in runners:
        twin = twins[name]
        method = twin.routed_experts.quant_method
        assert type(method).__name__ == "PagedVllmMethod" and method.num_slots == k
        for tensor in method.names:
            assert same_bits(method.rows.store.host_rows(method.layer_key, tensor),
                             getattr(runner.routed_experts, tensor).data), tensor
        width = runner.routed_experts.hidden_size
        for tokens in (1, 5, 13):
            gen = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, width, generator=gen)
            logits = x if getattr(runner, "gate", None) is not None else torch.randn(tokens, arch.num_experts,
                                                                                     generator=gen)
            try:
                want = _step(runner, plain_config, x.clone(), logits.clone())
            except Exception as exc:  # noqa: BLE001 - vLLM's CPU router, unpaged
                with pytest.raises(type(exc)):
                    _step(twin, paged_config, x.clone(), logits.clone())
                break
            got = _step(twin, paged_config, x.clone(), logits.clone())
            assert same_bits(got[0] if isinstance(got, tuple) else got,
                             want[0] if isinstance(want, tuple) else want), (name, tokens)
        else:
            continue
        return  # vLLM's CPU router cannot route this model's layers: nothing stepped
    _EXACT.add(arch.model_type)


def test_most_shared_architectures_page_exactly_here():
    """Run after the cases above (file order): the count docs/serving.md states."""
    assert len(_EXACT) >= 20, sorted(_EXACT)


# -- two CPU ranks: TP and EP -------------------------------------------------------------------------------------
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_two_ranks_each_page_their_share_exactly(expert_parallel, tmp_path):
    """vLLM's TP (each rank pages its shard of every expert: vLLM's loader shards the host rows) and EP (each rank
    pages its E / 2 experts; vLLM routes in global ids, the step takes the rank's local ones)."""
    import torch.multiprocessing as mp
    import vllm_ranks

    init = tmp_path / "init"
    mp.spawn(vllm_ranks.rank_main, args=(2, str(init), expert_parallel, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["rows_equal"] and seen["slot_rows"] == vllm_ranks.K
        if expert_parallel:
            assert seen["local_experts"] == E // 2 and seen["rows"][0][0] == E // 2
        else:
            assert seen["local_experts"] == E and seen["rows"][0] == [E, INTER, HIDDEN]  # 2 * INTER / 2 ranks
        assert all(step["equal"] for step in seen["steps"]), seen["steps"]
        assert seen["steps"][-1]["waves"] > 3
        # the rank's place (MoE TP rank, EP rank): what names its own disk-tier layout in a shared manifest
        assert seen["place"] == ([0, rank] if expert_parallel else [rank, 0])


# -- auto: K from the GPU budget ----------------------------------------------------------------------------------
def test_auto_sizes_k_from_the_gpu_budget_and_the_checkpoint(tmp_path, monkeypatch, caplog):
    """``num_resident: auto`` on vLLM's own model build: K from (a faked) GPU's memory x --gpu-memory-utilization
    less the KV reserve and non-expert weights, the checkpoint's headers giving the bytes; every layer gets it, the
    log says how; and the layers still page exactly. On the CPU (no fake) it refuses, saying it needs a GPU."""
    import logging

    from moepage.integrations import session
    from moepage.integrations.vllm import compat
    from moepage.planning.sizing import checkpoint_size

    path = _tiny_checkpoint(tmp_path, "mixtral", torch.bfloat16)
    size = checkpoint_size(path)
    with pytest.raises(ConfigError, match="auto needs a CUDA device to size against"):
        _model(path, {"num_resident": "auto"}, "bfloat16")
    fraction = EngineArgs.gpu_memory_utilization  # vLLM's default
    gpu = int((size.dense_bytes + 5 * size.slot_bytes) / 0.75 / fraction) + 1  # 25 % of the budget for KV: K = 5
    monkeypatch.setattr(compat, "gpu_bytes", lambda device: gpu)
    monkeypatch.setattr(session, "CHOSEN", {})
    with caplog.at_level(logging.INFO, logger="moepage.vllm"):
        paged, config = _model(path, {"num_resident": "auto"}, "bfloat16")
    methods = [m.routed_experts.quant_method for m in paged.modules() if type(m).__name__ == "MoERunner"]
    assert [m.num_slots for m in methods] == [5, 5]
    assert "auto chose K=5 of 8 experts" in caplog.text and f"gpu_memory_utilization {fraction:.3f}" in caplog.text
    plain, plain_config = _model(path, None, "bfloat16")
    runner = next(m for m in plain.modules() if type(m).__name__ == "MoERunner")
    x = torch.randn(9, HIDDEN).to(torch.bfloat16)
    logits = torch.randn(9, E).to(torch.bfloat16)
    twin = next(m for m in paged.modules() if type(m).__name__ == "MoERunner")
    assert same_bits(_step(twin, config, x, logits), _step(runner, plain_config, x, logits))
    monkeypatch.setattr(session, "CHOSEN", {})
    monkeypatch.setattr(compat, "gpu_bytes", lambda device: int(size.dense_bytes / fraction) + 1)  # no room for slots
    with pytest.raises(ConfigError, match="Raise --gpu-memory-utilization"):
        _model(path, {"num_resident": "auto"}, "bfloat16")


@pytest.mark.parametrize("tp, ep, share", [(1, False, (1, 1, 1)), (2, False, (2, 2, 1)), (2, True, (2, 1, 2))])
def test_auto_sizes_each_ranks_share(tp, ep, share):
    """What ``auto`` reads of vLLM's parallel config: TP shards attention and every expert, EP splits the experts."""
    from moepage.integrations.auto import RankShare
    from moepage.integrations.vllm import compat

    config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=ep))
    _, fraction, got = compat.auto_sizing(config)
    assert got == RankShare(*share) and fraction == config.cache_config.gpu_memory_utilization


def test_prefetch_under_ep_keeps_the_ranks_own_experts():
    """Under EP the next layer's gate predicts global ids; its expert map turns them into this rank's (-1: others)."""
    from moepage.integrations.vllm.prefetch import MappedExperts

    emap = torch.tensor([-1, -1, 0, 1, -1, -1, 2, 3])  # this rank holds global 2, 3, 6, 7 (a round-robin placement)
    predict = MappedExperts(lambda hidden: torch.tensor([[2, 0], [7, 6]]), emap)
    assert predict(torch.zeros(2, HIDDEN)).tolist() == [[0, -1], [3, 2]]


# -- a disk tier: H rows a layer in host memory, the rest on disk -------------------------------------------------
@pytest.mark.parametrize("dtype, compress", [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)])
def test_a_disk_tier_loads_through_files_and_steps_equal_unpaged(dtype, compress, tmp_path):
    """vLLM's loader writes the rows into files in the spill folder, which become the disk tier in place (with
    ``compress``: coded from them into a file of each tensor's, kept coded on disk and in the host tier, the staged
    files gone): every row reads back as the unpaged layer's, steps of 1, 2 and many waves equal unpaged with some
    rows read from disk, and the files go with the store."""
    import gc

    from moepage.backends.tiered import TieredStore

    checkpoint = _checkpoint(dtype, seed=4)
    plain, plain_config = _layer(None, dtype, checkpoint)
    chosen = {"num_resident": 3, "host_budget": 4, "spill_dir": str(tmp_path), "compress": compress}
    paged, paged_config = _layer(chosen, dtype, checkpoint)
    method = paged.routed_experts.quant_method
    store = method.rows.store
    assert isinstance(store, TieredStore) and store.held_rows(method.layer_key) == 4
    held = store.layer_bytes(method.layer_key)
    assert set(held.coded) == (set(method.names) if compress else set())
    files = [p.name for p in tmp_path.glob("*.moepage")]
    assert len(files) == len(method.names)  # a file a tensor: its staged rows, or its coded ones
    assert all(f.startswith("rows-" if compress else "staged-") for f in files), files
    for n in method.names:
        for e in range(E):
            assert same_bits(store.read_row(method.layer_key, n, e), getattr(plain.routed_experts, n).data[e])
    for tokens, distinct, seed in ((1, 2, 0), (4, 5, 1), (9, 8, 2), (17, 8, 3)):
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)
        logits = _logits(tokens, distinct, dtype, seed)
        assert same_bits(_step(paged, paged_config, x, logits), _step(plain, plain_config, x, logits))
    assert store.tier_stats(method.layer_key).host_misses > 0
    del paged, paged_config, method, store  # the config's forward context holds the layer too
    gc.collect()
    assert not list(tmp_path.glob("*.moepage"))  # the store's last layer gone: the store closed, its files with it


def test_block_fp8_rows_and_scales_on_disk_step_equal_unpaged(tmp_path):
    """A block-FP8 layer over a disk tier: its FP8 rows and float32 block scales read back from the files vLLM's loader
    wrote, steps of many waves with rows read from disk equal unpaged."""
    checkpoint = _fp8_checkpoint(seed=5)
    plain, plain_config = _fp8_layer(None, torch.bfloat16, checkpoint)
    paged, paged_config = _fp8_layer({"num_resident": 3, "host_budget": 4, "spill_dir": str(tmp_path)},
                                     torch.bfloat16, checkpoint)
    method = paged.routed_experts.quant_method
    store = method.rows.store
    assert len(list(tmp_path.glob("*.moepage"))) == len(method.names) == 4  # FP8 weights and scales, a file each
    for n in method.names:
        for e in range(E):
            assert same_bits(store.read_row(method.layer_key, n, e), getattr(plain.routed_experts, n).data[e])
    for tokens, distinct, seed in ((1, 2, 0), (9, 8, 2), (17, 8, 3)):
        x = torch.randn(tokens, FP8_H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        logits = _logits(tokens, distinct, torch.bfloat16, seed)
        assert same_bits(_step(paged, paged_config, x, logits), _step(plain, plain_config, x, logits))
    assert store.tier_stats(method.layer_key).host_misses > 0


def test_a_restart_reuses_the_rows_an_earlier_start_laid_out(tmp_path, monkeypatch):
    """vLLM's model and loader over a disk tier: each row vLLM's loader takes unchanged from the checkpoint is read
    where the checkpoint holds it (no copy written; a fused gate-and-up row from two places), the layout named in the
    folder's manifest; the next start of the same checkpoint stages no row, and every row and step equals unpaged."""
    import gc

    from moepage.integrations import rows, session

    session.reset()  # a fresh process: earlier cases' models (still held by vLLM's globals) no longer hold names
    path = _tiny_checkpoint(tmp_path, "mixtral", torch.float32)
    spill = tmp_path / "rows"
    chosen = {"num_resident": 3, "host_budget": 4, "spill_dir": str(spill)}
    plain, plain_config = _model(path, None, "float32")
    first, first_config = _model(path, chosen, "float32")
    assert (spill / "manifest.json").exists() and not list(spill.glob("*.moepage"))
    methods = [m.routed_experts.quant_method for m in first.modules() if type(m).__name__ == "MoERunner"]
    extents = {(n, len(row), x.path) for m in methods for (_, n), r in m.rows.store.disk.rows.items() for row in r
               for x in row}
    weights = str(next(path.glob("*.safetensors")).resolve())
    assert extents == {("w13_weight", 2, weights), ("w2_weight", 1, weights)}
    kept = (spill / "manifest.json").read_text()
    del first, first_config, methods
    gc.collect()
    session.reset()  # the process ends (vLLM's globals still hold the model here): its stores close, the rows stay
    assert (spill / "manifest.json").read_text() == kept

    def refuse(*args):
        raise AssertionError("a row was staged again")

    monkeypatch.setattr(rows, "staged_rows", refuse)
    again, config = _model(path, chosen, "float32")
    twins = dict(again.named_modules())
    for name, runner in [(n, m) for n, m in plain.named_modules() if type(m).__name__ == "MoERunner"]:
        method = twins[name].routed_experts.quant_method
        for n in method.names:
            for e in range(E):
                assert same_bits(method.rows.store.read_row(method.layer_key, n, e),
                                 getattr(runner.routed_experts, n).data[e])
        gate = dict(plain.named_modules())[name.rsplit(".experts", 1)[0] + ".gate"]
        for tokens in (1, 4, 17):
            x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
            logits = torch.nn.functional.linear(x.float(), gate.weight.float())
            assert same_bits(_step(twins[name], config, x, logits), _step(runner, plain_config, x, logits))
    assert (spill / "manifest.json").read_text() == kept


@pytest.mark.parametrize("chosen, launch, says", [
    ({"host_budget": 4}, {}, "keeps experts on disk: pass --paged-experts-spill-dir DIR"),
    ({"spill_dir": "/tmp/x"}, {}, "--paged-experts-spill-dir is for --paged-experts-host-budget"),
    ({"host_budget": "lots", "spill_dir": "/tmp/x"}, {}, "not a number of host rows or a byte size"),
    ({"host_budget": 4, "spill_dir": "/tmp/x"}, {"cuda_graphs": True}, "serve with --enforce-eager"),
    ({"host_warm": "t.npz"}, {}, "--paged-experts-host-warm t.npz is for --paged-experts-host-budget"),
])
def test_a_disk_tier_that_cannot_work_is_refused_at_startup(chosen, launch, says):
    with pytest.raises(ConfigError) as err:
        checks.check(checks.Launch(**launch), settings.options({"moepage": {"num_resident": 3, **chosen}}))
    assert says in str(err.value)
    checks.check(checks.Launch(), settings.options({"moepage": {"num_resident": 3, "host_budget": 4,
                                                                 "spill_dir": "/tmp/x"}}))  # eager: served


def test_a_spill_folder_that_cannot_be_one_is_refused_at_startup_naming_how_it_was_given(tmp_path, monkeypatch):
    """A file (or a path under one) is no spill folder: refused with the launch's other problems when vLLM's config is
    made, naming the flag or the variable it came by (as ``wrap`` checks it), not a raw error at build."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError) as err:
        checks.check(checks.Launch(), {"num_resident": 3, "host_budget": 4, "spill_dir": str(afile), "policy": "fifo"})
    text = str(err.value)
    assert f"--paged-experts-spill-dir '{afile}': {afile} is a file, not a folder" in text
    assert "--paged-experts-policy" in text  # said with the other problems, at once
    monkeypatch.setenv("MOEPAGE_SPILL_DIR", str(afile / "rows"))
    with pytest.raises(ConfigError, match=f"MOEPAGE_SPILL_DIR '{afile}/rows': {afile} is a file, not a folder"):
        _layer({"num_resident": 3, "host_budget": 4}, torch.bfloat16, _checkpoint(torch.bfloat16))


def test_the_host_tier_starts_with_the_experts_a_trace_routes_to_most(tmp_path):
    """``host_warm``: the layer's host tier holds the trace's H most routed experts at startup (counted as no step's
    misses), steps equal unpaged; a trace of another model's expert count is refused naming the file."""
    import numpy as np

    from moepage.integrations import session
    from moepage.planning.traces import save_simple

    session.reset()  # a fresh process: this layer is MoE layer 0
    hot = (6, 7, 5, 1, 0)
    ids = np.full((10, 1, len(hot)), -1, dtype=np.int32)
    for i, e in enumerate(hot):
        ids[: 10 - 2 * i, 0, i] = e
    save_simple(tmp_path / "trace.npz", ids, E, TOP_K)
    checkpoint = _checkpoint(torch.bfloat16, seed=6)
    chosen = {"num_resident": 3, "host_budget": 4, "spill_dir": str(tmp_path / "rows"),
              "host_warm": str(tmp_path / "trace.npz")}
    plain, plain_config = _layer(None, torch.bfloat16, checkpoint)
    paged, paged_config = _layer(chosen, torch.bfloat16, checkpoint)
    method = paged.routed_experts.quant_method
    store = method.rows.store
    tier = store._layers[method.layer_key].residency
    assert {e for e in range(E) if tier.expert_slot[e] >= 0} == set(hot[:4])
    assert store.tier_stats(method.layer_key).host_misses == 0
    for tokens, distinct, seed in ((1, 2, 0), (9, 8, 2)):
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        logits = _logits(tokens, distinct, torch.bfloat16, seed)
        assert same_bits(_step(paged, paged_config, x, logits), _step(plain, plain_config, x, logits))
    save_simple(tmp_path / "e16.npz", ids, 16, TOP_K)
    session.reset()
    with pytest.raises(ConfigError, match=r"e16.npz': MoE layer 0 \(.*\): its routing is over E=16 experts, not 8"):
        _layer({**chosen, "host_warm": str(tmp_path / "e16.npz")}, torch.bfloat16, checkpoint)


def test_host_rows_below_k_are_refused_naming_the_layer(tmp_path):
    with pytest.raises(ConfigError, match=r"layer .*experts: --paged-experts-host-budget 2 holds 2 expert rows in each "
                                          "MoE layer, fewer than its K=3 slots"):
        _layer({"num_resident": 3, "host_budget": 2, "spill_dir": str(tmp_path)}, torch.bfloat16,
               _checkpoint(torch.bfloat16))
    assert not list(tmp_path.iterdir())  # refused before any file was made


def _runners(model) -> list:
    return [m for m in model.modules() if type(m).__name__ == "MoERunner"]


@pytest.mark.parametrize("served, stored, h", [("float32", torch.bfloat16, 3), ("bfloat16", torch.float32, 6)])
def test_a_byte_budget_counts_the_rows_at_the_dtype_they_are_served_in(served, stored, h, tmp_path):
    """A checkpoint stored in one dtype and served in another (``--dtype``): a byte budget buys rows as the layers
    hold them (the served dtype), not as the checkpoint stores them: H rows in every MoE layer fit it, H + 1 do not.
    float32: vLLM's model and loader; bfloat16 (vLLM's CPU GEMMs of the rest take no bf16): one layer of it."""
    from moepage.integrations import session
    from moepage.planning.sizing import checkpoint_size

    session.reset()  # a fresh process (vLLM's globals hold earlier cases' models)
    path = _tiny_checkpoint(tmp_path, "mixtral", stored)
    layers = checkpoint_size(path).num_layers
    row = 3 * INTER * HIDDEN * getattr(torch, served).itemsize  # gate, up and down of one expert, served
    budget = (h + 1) * row * layers - 1
    chosen = {"num_resident": 3, "host_budget": f"{budget}B", "spill_dir": str(tmp_path / "rows")}
    if served == "float32":
        runners = _runners(_model(path, chosen, served)[0])
        assert len(runners) == layers
    else:  # the layer of a launch serving this checkpoint (its folder: the layers the budget is shared by)
        launch = EngineArgs(model=str(path), skip_tokenizer_init=True, enforce_eager=True,
                            dtype=served).create_engine_config()
        runners = [vllm_layers.build(chosen, _checkpoint(torch.bfloat16), device="cpu", num_experts=E, top_k=TOP_K,
                                     hidden_size=HIDDEN, intermediate_size=INTER, params_dtype=torch.bfloat16,
                                     config={"model_config": launch.model_config})[0]]
    for runner in runners:
        method = runner.routed_experts.quant_method
        held = sum(getattr(runner.routed_experts, n)[0].nbytes for n in method.names)  # one row as the layer holds it
        assert held == row and method.rows.store.held_rows(method.layer_key) == h
        assert h * held * layers <= budget < (h + 1) * held * layers


@pytest.mark.parametrize("budget", [E, E + 1, "every row's bytes"])
def test_a_budget_that_holds_every_expert_makes_no_disk_tier_and_says_so_once(budget, tmp_path, caplog):
    """H >= E, as rows or as bytes: the rows stay in host memory, no disk tier is made (nothing in the spill folder),
    one warning names the option and says so; steps equal unpaged."""
    import logging

    from moepage.backends.tiered import TieredStore
    from moepage.integrations import session
    from moepage.planning.sizing import checkpoint_size

    session.reset()
    path = _tiny_checkpoint(tmp_path, "mixtral", torch.float32)
    if budget == "every row's bytes":
        budget = f"{checkpoint_size(path).experts_total_bytes}B"
    plain, plain_config = _model(path, None, "float32")
    with caplog.at_level(logging.WARNING, logger="moepage"):
        paged, config = _model(path, {"num_resident": 3, "host_budget": budget, "spill_dir": str(tmp_path / "rows")},
                               "float32")
    said = [r.getMessage() for r in caplog.records if "no disk tier is needed" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"moepage: --paged-experts-host-budget {budget} holds every expert of "
                                                 f"each MoE layer (E={E}")
    assert not (tmp_path / "rows").exists()
    twins = dict(paged.named_modules())
    for name, runner in [(n, m) for n, m in plain.named_modules() if type(m).__name__ == "MoERunner"]:
        method = twins[name].routed_experts.quant_method
        assert method.rows.tier is None and not isinstance(method.rows.store, TieredStore)
        x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(1))
        gate = dict(plain.named_modules())[name.rsplit(".experts", 1)[0] + ".gate"]
        logits = torch.nn.functional.linear(x.float(), gate.weight.float())
        assert same_bits(_step(twins[name], config, x, logits), _step(runner, plain_config, x, logits))


# -- a CPU share (--paged-experts-cpu-share) ----------------------------------------------------------------------
SPLIT_TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}  # relative to the largest output (docs/cpu-split.md)


def _split_steps(plain, plain_config, paged, paged_config, dtype, exact: bool = False) -> None:
    """Steps of one, two and many waves: equal to unpaged (bit for bit where ``exact``, else within the tolerance),
    every routed expert a hit, a miss or a CPU expert."""
    pager = paged.routed_experts.quant_method.pager
    for tokens, distinct in ((1, 2), (2, 4), (3, 6), (8, 8), (5, 8)):
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        logits = _logits(tokens, distinct, dtype, seed=tokens * 10 + distinct)
        before = pager.read_stats()
        got, want = _step(paged, paged_config, x, logits), _step(plain, plain_config, x, logits)
        after = pager.read_stats()
        assert (after.hits + after.misses + after.cpu) - (before.hits + before.misses + before.cpu) == distinct
        if exact:
            assert same_bits(got, want), (tokens, distinct)
        else:
            scale = want.float().abs().max().item()
            assert (got.float() - want.float()).abs().max().item() <= SPLIT_TOLERANCE[dtype] * scale, (tokens, distinct)


@pytest.mark.parametrize("share", ["1.0", "0.5"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_steps_equal_unpaged_within_the_tolerance(share, dtype):
    checkpoint = _checkpoint(dtype, seed=5)
    plain, plain_config = _layer(None, dtype, checkpoint)
    paged, paged_config = _layer({"num_resident": 3, "cpu_share": share}, dtype, checkpoint)
    pager = paged.routed_experts.quant_method.pager
    assert pager.split is not None and pager.split.expert is not None
    _split_steps(plain, plain_config, paged, paged_config, dtype)
    assert pager.counts.cpu > 0


def test_a_split_the_cost_model_declines_is_bit_exact():
    from moepage.split import Costs

    checkpoint = _checkpoint(torch.bfloat16, seed=6)
    plain, plain_config = _layer(None, torch.bfloat16, checkpoint)
    paged, paged_config = _layer({"num_resident": 3, "cpu_share": "auto"}, torch.bfloat16, checkpoint)
    split = paged.routed_experts.quant_method.pager.split
    assert split.costs is not None  # measured at post-load
    split.costs = Costs(1e-6, (1,), (1.0,))  # a CPU far slower than the link
    _split_steps(plain, plain_config, paged, paged_config, torch.bfloat16, exact=True)
    assert paged.routed_experts.quant_method.pager.counts.cpu == 0


@pytest.mark.parametrize("chosen, launch, says", [
    ({"cpu_share": "auto"}, {"cuda_graphs": True}, "--paged-experts-cpu-share: a split step is planned on the host, "
                                                   "which vLLM's CUDA graphs cannot replay"),
    ({"cpu_share": "most"}, {}, "--paged-experts-cpu-share: 'most' is not off, auto or a share in (0, 1]"),
])
def test_a_split_that_cannot_work_is_refused_at_startup(chosen, launch, says):
    with pytest.raises(ConfigError) as err:
        checks.check(checks.Launch(**launch), settings.options({"moepage": {"num_resident": 3, **chosen}}))
    assert says in str(err.value)
    checks.check(checks.Launch(), settings.options({"moepage": {"num_resident": 3, "cpu_share": "auto"}}))  # eager


def test_a_split_of_quantized_experts_is_refused_naming_the_layer():
    with pytest.raises(ConfigError) as err:
        _fp8_layer({"num_resident": 3, "cpu_share": "0.5"}, torch.bfloat16, {})
    text = str(err.value)
    assert "--paged-experts-cpu-share: its experts are quantized" in text and "model.layers." in text
