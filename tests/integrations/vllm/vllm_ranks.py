"""One rank of a two-rank vLLM run on the CPU (gloo), for ``vllm_cases``: vLLM's own process groups, then the same
MoE layer built by vLLM's factory unpaged and paged under TP (each rank holds a shard of every expert) or EP (each
rank holds E / 2 experts and vLLM routes in global ids), loaded through vLLM's loader and stepped. Writes what it saw
to ``out/rank<r>.json``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

E, TOP_K, HIDDEN, INTER, K = 8, 2, 64, 32, 3


def rank_main(rank: int, world: int, init_file: str, expert_parallel: bool, out: str) -> None:
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    import vllm_double
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory
    from vllm.plugins import load_general_plugins

    from moepage.bits import same_bits
    from moepage.integrations.vllm import compat

    vllm_double.install()
    load_general_plugins()
    torch.set_grad_enabled(False)

    def config(chosen=None):
        return VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=world,
                                                         enable_expert_parallel=expert_parallel),
                          additional_config={"moepage": chosen} if chosen else {})

    with set_current_vllm_config(config()):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"file://{init_file}")
        initialize_model_parallel(world, 1)
    gen = torch.Generator().manual_seed(0)
    shapes = (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER)))
    checkpoint = {f"{e}.{name}.weight": (torch.randn(shape, generator=gen) * 0.1).to(torch.bfloat16)
                  for e in range(E) for name, shape in shapes}
    built = []
    for i, chosen in enumerate((None, {"num_resident": K})):
        cfg = config(chosen)
        with set_current_vllm_config(cfg), torch.device("cpu"):
            runner = FusedMoEFactory(num_experts=E, top_k=TOP_K, hidden_size=HIDDEN, intermediate_size=INTER,
                                     params_dtype=torch.bfloat16, renormalize=True,
                                     prefix=f"model.layers.{i}.mlp.experts")
            list(runner.load_weights(checkpoint.items()))
            runner.routed_experts.quant_method.process_weights_after_loading(runner.routed_experts)
        built.append((runner, cfg))
    (plain, plain_cfg), (paged, paged_cfg) = built
    method = paged.routed_experts.quant_method
    seen = {"local_experts": method.num_experts, "slot_rows": paged.routed_experts.w13_weight.shape[0],
            "rows": [list(method.rows.store.host_rows(method.layer_key, n).shape) for n in method.names],
            "rows_equal": all(same_bits(method.rows.store.host_rows(method.layer_key, n),
                                        getattr(plain.routed_experts, n).data) for n in method.names),
            "steps": [], "place": list(compat.rank_place(paged.routed_experts))}
    gen = torch.Generator().manual_seed(1)
    for tokens in (1, 3, 9):
        x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
        logits = torch.randn(tokens, E, generator=gen).to(torch.bfloat16)
        with set_forward_context(None, plain_cfg):
            want = plain(hidden_states=x, router_logits=logits)
        with set_forward_context(None, paged_cfg):
            got = paged(hidden_states=x, router_logits=logits)
        seen["steps"].append({"tokens": tokens, "equal": same_bits(got, want), "waves": method.pager.counts.waves})
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
