"""One MoE layer as vLLM builds it, for the CPU cases (``vllm_cases``) and the GPU cases (``vllm_gpu_cases``): vLLM's
factory under moepage's options, vLLM's own loader and post-load step. It installs no stand-in kernel, so the GPU
cases may import it."""

from __future__ import annotations

import itertools

import torch
from vllm.config import LoadConfig, VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

_numbers = itertools.count(1)  # each layer a name of its own: a split file and the plugin's messages key layers by it


def build(chosen: dict | None, checkpoint: dict, *, device: str, prefix: str | None = None,
          config: dict | None = None, dummy: bool = False, **factory) -> tuple[object, VllmConfig]:
    """A MoE runner built by vLLM's factory (``factory``: its keyword arguments) under a config with moepage's options
    ``chosen`` (and ``config``: more of VllmConfig's), loaded with ``checkpoint``, or with ``dummy`` under
    ``--load-format dummy`` by vLLM's ``DummyModelLoader`` (its fill of every tensor of the runner); (runner,
    config)."""
    config = {**(config or {}), **({"load_config": LoadConfig(load_format="dummy")} if dummy else {})}
    vllm_config = VllmConfig(**config, additional_config={"moepage": chosen} if chosen else {})
    prefix = prefix or f"model.layers.{next(_numbers)}.mlp.experts"
    with set_current_vllm_config(vllm_config), torch.device(device):
        runner = FusedMoEFactory(renormalize=True, prefix=prefix, **factory)
        if dummy:
            DummyModelLoader(vllm_config.load_config).load_weights(runner, vllm_config.model_config)
        else:
            list(runner.load_weights(checkpoint.items()))
        experts = runner.routed_experts
        experts.quant_method.process_weights_after_loading(experts)
    return runner, vllm_config


def step(runner, config: VllmConfig, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """One forward of ``runner`` as vLLM's model runner calls it."""
    with set_forward_context(None, config):
        return runner(hidden_states=x, router_logits=logits)
