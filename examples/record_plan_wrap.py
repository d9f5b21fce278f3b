"""Record a model's routing, plan a per-layer slot split from it, and generate with that split paged.

Builds a tiny random Qwen3-MoE checkpoint (4 layers, 16 experts, top-4) in a temporary directory, records the routing
of greedy generation over a few prompts (``record_routing``: hooks on the experts modules, removed afterwards), splits
a budget of half the experts per layer on average across the layers to minimise the trace's misses (``plan_split``),
loads the checkpoint paged with that split (``from_pretrained(..., resident=split.json)``) and checks that its greedy
tokens equal the unpaged model's. CPU, a few seconds, no download. The same flow from the command line:

    moepage record CKPT --prompts prompts.txt --out trace.npz      # or --token-ids ids.txt
    moepage plan --trace trace.npz --budget 0.5 --out split.json
    python -c "from moepage.integrations import transformers as mhf; mhf.from_pretrained('CKPT', resident='split.json')"
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import moepage
from moepage.integrations import transformers as mhf
from moepage.integrations.transformers.record import record_routing
from moepage.planning import budgets, traces

NEW_TOKENS = 8


def tiny_qwen3_moe(path: str) -> torch.nn.Module:
    """A random Qwen3-MoE saved at ``path``; returned in memory as the unpaged reference."""
    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, head_dim=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=16,
        num_experts_per_tok=4, initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    return model


def greedy(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


def main() -> int:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (1, n), generator=g) for n in (24, 16, 32)]
    held_out = torch.randint(0, 512, (1, 20), generator=g)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(Path(tmp) / "ckpt")
        unpaged = tiny_qwen3_moe(ckpt)

        trace = record_routing(unpaged, prompts, NEW_TOKENS, name="tiny-qwen3-moe")
        trace_path = Path(tmp) / "trace.npz"
        traces.save_trace(trace, trace_path)
        print(f"recorded {trace.num_steps} steps ({len(trace.prefill_steps)} prefill) of {len(trace.layers)} MoE "
              f"layers, E={trace.num_experts}, top_k={trace.top_k}")

        trace = traces.load_trace(trace_path)
        split = budgets.plan_split(trace, budgets.parse_budget("0.5", trace))
        split_path = Path(tmp) / "split.json"
        budgets.save_split(split, split_path)
        print(budgets.format_split(split))

        paged = mhf.from_pretrained(ckpt, resident=str(split_path), device="cpu", progress=False)
        print("resident per layer:", [layer.num_slots for layer in moepage.paged_layers(paged)])
        same = True
        for name, ids in [*((f"recorded prompt {i}", p) for i, p in enumerate(prompts)), ("held-out", held_out)]:
            want, got = greedy(unpaged, ids), greedy(paged, ids)
            same &= torch.equal(want, got)
            print(f"  {name}: {got[0, ids.shape[1]:].tolist()}{'' if torch.equal(want, got) else '  DIFFERS'}")
        total = moepage.stats(paged).total
        print(f"paged: {total.hits} hits, {total.misses} misses over {total.steps} layer steps")
        print(f"paged output equals unpaged: {same}")
        moepage.unwrap(paged)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
