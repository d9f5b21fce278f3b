"""moepage quickstart: page the experts of a small MoE model and check the output is unchanged.

A 4-layer model with 16 experts per layer and top-4 routing keeps only K=6 experts per layer on
the device; the rest live in host memory and are paged in as the router asks for them. Runs on
CUDA when present, else on the CPU.

    python examples/quickstart.py
"""

from __future__ import annotations

import copy
import time

import torch

import moepage
from moepage.toy import ToyMoE


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = ToyMoE(vocab=512, hidden=128, inter=256, layers=4, num_experts=16, top_k=4).to(dtype).eval()
    reference = copy.deepcopy(model).to(device)  # the unpaged model, for comparison

    moepage.wrap(model, resident=6, device=device)  # 6 of 16 experts per layer on the device
    print(f"device {device}, dtype {dtype}: 4 layers x 16 experts, top-4, K=6 resident")

    prompts = [torch.randint(0, 512, (n,), device=device) for n in (5, 33, 120)]
    start = time.perf_counter()
    all_equal = True
    with torch.inference_mode():  # moepage computes no gradients: run it as inference
        for i, prompt in enumerate(prompts):
            paged = model.generate(prompt, new_tokens=8)
            unpaged = reference.generate(prompt, new_tokens=8)
            equal = torch.equal(paged, unpaged) and torch.equal(model(paged), reference(paged))
            all_equal &= equal
            print(f"prompt {i} ({len(prompt)} tokens): generated {paged[len(prompt):].tolist()}  "
                  f"paged == unpaged: {equal}")
    elapsed = time.perf_counter() - start

    total = moepage.stats(model).total
    print(
        f"steps {total.steps}, waves {total.waves}, hits {total.hits}, misses {total.misses}, "
        f"hit rate {total.hit_rate:.1%}, bytes paged {total.bytes_paged / 2**20:.1f} MiB, {elapsed:.1f} s"
    )
    print("paged equals unpaged:", all_equal)
    if not all_equal or total.misses == 0:
        raise SystemExit("quickstart check failed")


if __name__ == "__main__":
    main()
