"""Hugging Face decode benchmark (issue 4), on a CUDA GPU; prints markdown tables.

A Qwen3-MoE-shaped model (Qwen3-30B-A3B expert shapes: E=128, top-8, H=2048, I=768; bf16, random
weights, ``--layers`` MoE layers) decodes greedily:
- unpaged (everything on the GPU), and paged at K/E = 25, 50, 75, 100 %;
- accelerate ``device_map`` offload with the GPU budget of the K/E = 25 % run;
- the physics bound of each paged run: unpaged step time + missed bytes / cudaMemcpyAsync GB/s
  (one large pinned copy measured in this run).
Random weights route near-uniformly: the worst case for any cache.

``--budget-load``: the over-budget proof. Saves the model as a safetensors checkpoint, then in a
child process caps GPU memory below the full expert set, loads it with
``moepage.integrations.transformers.from_pretrained`` and checks its greedy tokens equal the
unpaged run's.

    python -m bench.models.hf_bench [--layers 8] [--new-tokens 16] [--budget-load DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time

import torch

import moepage
from bench.common import bound_ms, memcpy_gbs, table, write_json

DEV = torch.device("cuda")


def build(layers: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    for _n, p in model.named_parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
    return model


def decode(model, prompt: torch.Tensor, new_tokens: int, trials: int = 3) -> tuple[torch.Tensor, float, float, float]:
    """``decode_once`` ``trials`` times; the median time (timings on a shared host are noisy)."""
    runs = [decode_once(model, prompt, new_tokens) for _ in range(trials)]
    times = sorted(r[1] for r in runs)
    out, _, missed, hit_rate = runs[-1]
    return out, times[len(times) // 2], missed, hit_rate


def decode_once(model, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float, float, float]:
    """Greedy tokens, seconds per decoded token (prefill excluded, by difference with a one-token
    run), and for a paged model the bytes paged per decoded token and the hit rate of the run."""
    model.generate(prompt, max_new_tokens=2, do_sample=False)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = model.generate(prompt, max_new_tokens=1, do_sample=False)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    before = moepage.stats(model).total
    out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    after = moepage.stats(model).total
    per_token = ((t2 - t1) - (t1 - t0)) / (new_tokens - 1)
    assert torch.equal(out[:, : first.shape[1]], first)
    looked = (after.hits + after.misses) - (before.hits + before.misses)
    hit_rate = (after.hits - before.hits) / looked if looked else float("nan")
    return out, per_token, (after.bytes_paged - before.bytes_paged) / new_tokens, hit_rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--budget-load", help="checkpoint dir for the over-budget load proof")
    ap.add_argument("--child-load", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.child_load:
        return child_load(args.child_load, args.new_tokens)

    model = build(args.layers)
    e, row_bytes = 128, (2 * 768 * 2048 + 2048 * 768) * 2
    expert_gb = args.layers * e * row_bytes / 1e9
    prompt = torch.randint(0, 32000, (1, 8), device=DEV)
    bw = memcpy_gbs()
    decode(model, prompt, 2)  # first-use costs (kernel selection, allocator growth) out of the timings
    ref_tokens, t_unpaged, _, _ = decode(model, prompt, args.new_tokens)
    print(f"device {torch.cuda.get_device_name()}; {args.layers} MoE layers, experts {expert_gb:.1f} GB bf16; "
          f"pinned H2D memcpy {bw:.1f} GB/s; unpaged decode {t_unpaged * 1e3:.2f} ms/token; "
          f"experts implementation {model.config._experts_implementation}")
    rows = [dict(run="unpaged (all on GPU)", k_over_e="-", ms_per_token=t_unpaged * 1e3, tok_s=1 / t_unpaged,
                 hit_rate="-", bound_ms="-", equal="ref")]
    for frac in (0.25, 0.5, 0.75, 1.0):
        paged = copy.deepcopy(model)
        moepage.wrap(paged, resident=int(e * frac), device=DEV)
        tokens, t, missed_per_token, hit_rate = decode(paged, prompt, args.new_tokens)
        # Bound: the unpaged step plus the bytes this run paged per token at the link's peak
        # (the prompt's prefill misses are spread over the tokens: slightly pessimistic).
        bound = bound_ms(t_unpaged * 1e3, missed_per_token, bw)
        rows.append(dict(run="moepage", k_over_e=f"{frac:.0%}", ms_per_token=t * 1e3, tok_s=1 / t,
                         hit_rate=f"{hit_rate:.1%}", bound_ms=f"{bound:.2f}",
                         equal=str(torch.equal(tokens, ref_tokens))))
        del paged
        torch.cuda.empty_cache()
    rows.append(accelerate_run(model, prompt, args.new_tokens, ref_tokens, args.layers, row_bytes))
    again, t_again, _, _ = decode(model, prompt, args.new_tokens)  # order effects: unpaged again, last
    rows.append(dict(run="unpaged again (after the paged runs)", k_over_e="-", ms_per_token=t_again * 1e3,
                     tok_s=1 / t_again, hit_rate="-", bound_ms="-", equal=str(torch.equal(again, ref_tokens))))
    print(table(rows))
    if args.budget_load:
        rows_b = budget_load(model, args.budget_load, ref_tokens, args.new_tokens)
        print(table(rows_b))
    write_json(args.json, rows)


def accelerate_run(model, prompt, new_tokens, ref_tokens, layers, row_bytes) -> dict:
    """accelerate's device_map offload with the GPU holding what moepage's K/E=25% run holds."""
    from accelerate import dispatch_model, infer_auto_device_map

    cpu_model = copy.deepcopy(model).to("cpu")
    budget = int(layers * 32 * row_bytes + 2.0e9)  # the 25 % slots + dense weights and activations
    device_map = infer_auto_device_map(cpu_model, max_memory={0: budget, "cpu": 100 * 2**30},
                                       no_split_module_classes=["Qwen3MoeDecoderLayer"])
    off = dispatch_model(cpu_model, device_map=device_map)
    n = max(3, new_tokens // 4)
    tokens, t, _, _ = decode(off, prompt, n, trials=1)
    equal = torch.equal(tokens, ref_tokens[:, : tokens.shape[1]])
    on_gpu = sum(1 for v in device_map.values() if v == 0)
    return dict(run=f"accelerate device_map ({on_gpu}/{len(device_map)} modules on GPU)", k_over_e="budget of 25%",
                ms_per_token=t * 1e3, tok_s=1 / t, hit_rate="-", bound_ms="-", equal=str(equal))


def budget_load(model, path: str, ref_tokens: torch.Tensor, new_tokens: int) -> list[dict]:
    model.save_pretrained(path)
    torch.save(ref_tokens.cpu(), os.path.join(path, "ref_tokens.pt"))
    out = subprocess.run([sys.executable, "-m", "bench.models.hf_bench", "--child-load", path,
                          "--new-tokens", str(new_tokens)],
                         capture_output=True, text=True)
    print(out.stdout[-4000:], out.stderr[-4000:])
    return [json.loads(out.stdout.strip().splitlines()[-1])]


def child_load(path: str, new_tokens: int) -> None:
    from transformers import AutoConfig

    from moepage.integrations.transformers import from_pretrained

    free, total = torch.cuda.mem_get_info()
    cfg = AutoConfig.from_pretrained(path)
    layers, e = cfg.num_hidden_layers, cfg.num_experts
    row_bytes = (2 * 768 * 2048 + 2048 * 768) * 2
    experts = layers * e * row_bytes
    k = 32
    budget = int(layers * k * row_bytes + 1.5e9)  # slots + dense weights + activations
    assert budget < experts, "the budget must be below the full expert set"
    torch.cuda.set_per_process_memory_fraction(budget / total)
    model = from_pretrained(path, resident=k, device="cuda", dtype=torch.bfloat16, progress=False)
    ref = torch.load(os.path.join(path, "ref_tokens.pt")).to(DEV)
    tokens = model.generate(ref[:, :8], max_new_tokens=new_tokens, do_sample=False)
    peak = torch.cuda.max_memory_allocated()
    print(json.dumps(dict(run="from_pretrained under a GPU budget", budget_gb=budget / 1e9,
                          experts_gb=experts / 1e9, peak_gpu_gb=peak / 1e9, k=k,
                          equal=bool(torch.equal(tokens, ref)))))


if __name__ == "__main__":
    main()
