"""Generate with a Hugging Face MoE checkpoint whose routed experts are paged by moepage.

By default builds a tiny random Qwen3-MoE checkpoint (4 layers, 16 experts, top-4) in a temporary
directory, loads it with ``moepage.integrations.transformers.from_pretrained`` keeping K=6 of 16
experts per layer on the device, generates greedily and checks tokens and logits against the
unpaged model loaded by transformers. CUDA (bf16) when present, else CPU (fp32).

    python examples/hf_generate.py
    python examples/hf_generate.py --model /path/to/local/checkpoint --resident 16 --no-reference
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import moepage
from moepage.integrations import transformers as mhf


def tiny_qwen3_moe(path: str) -> None:
    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, head_dim=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=16,
        num_experts_per_tok=4, initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)  # per-expert keys, as on the hub


def prompt_ids(path: str, text: str | None, vocab: int, device: torch.device) -> torch.Tensor:
    if text is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)(text, return_tensors="pt").input_ids.to(device)
    return torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(0)).to(device)


def generate(model, ids, tokens):
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, out.logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local safetensors checkpoint (default: a tiny random Qwen3-MoE)")
    parser.add_argument("--resident", type=int, default=6, help="K, experts per layer kept on the device")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens to generate")
    parser.add_argument("--prompt", help="text prompt (needs a tokenizer in --model)")
    parser.add_argument("--no-reference", action="store_true", help="skip the unpaged comparison")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tmp = None
    path = args.model
    if path is None:
        tmp = tempfile.TemporaryDirectory()
        path = tmp.name
        tiny_qwen3_moe(path)

    start = time.perf_counter()
    model = mhf.from_pretrained(path, resident=args.resident, device=device, dtype=dtype)
    print(f"loaded {path} on {device} ({dtype}) in {time.perf_counter() - start:.1f}s: "
          f"{len(list(moepage.paged_layers(model)))} paged layers, K={args.resident} of "
          f"{next(iter(moepage.paged_layers(model))).num_experts} experts resident")
    ids = prompt_ids(path, args.prompt, model.config.vocab_size, device)

    start = time.perf_counter()
    sequences, logits = generate(model, ids, args.tokens)
    elapsed = time.perf_counter() - start
    new = sequences[0, ids.shape[1]:].tolist()
    print(f"generated {len(new)} tokens in {elapsed:.2f}s: {new}")

    total = moepage.stats(model).total
    print(f"hit rate {total.hit_rate:.1%}, {total.misses} experts paged in "
          f"({total.bytes_paged / 2**20:.1f} MiB) over {total.steps} layer steps, {total.waves} waves")

    if not args.no_reference:
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        for p in reference.parameters():  # owned, aligned storage (not safetensors' mmap), as moepage's
            p.data = p.data.clone()
        ref_sequences, ref_logits = generate(reference.to(device).eval(), ids, args.tokens)
        same = torch.equal(ref_sequences, sequences) and all(map(torch.equal, ref_logits, logits))
        print(f"equal to the unpaged model (tokens and every step's logits): {same}")
        if not same:
            raise SystemExit(1)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
