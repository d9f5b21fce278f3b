"""The committed tiny trained Qwen3-MoE (``helpers.tiny``): it loads with transformers and with
moepage's loader, and paged equals unpaged on real text. (Its routing statistics are checked by
the routing analysis itself: ``bench/analysis/routing_analysis.py --check``, run by the bench
smoke tests.)"""

from __future__ import annotations

import safetensors  # noqa: F401  (the [test] extra installs it)
import torch
import transformers  # noqa: F401  (the [test] extra installs it)

import moepage  # noqa: E402
from helpers.tiny import CKPT, PAD, encode  # noqa: E402
from moepage.integrations import transformers as mhf  # noqa: E402


def test_paged_generation_equals_unpaged(one_thread):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
    for p in ref.parameters():  # owned, aligned storage as moepage's loader gives (docs/architectures.md)
        p.data = p.data.clone()
    k = ref.config.num_experts_per_tok + 1  # the prompt needs several waves
    paged = mhf.from_pretrained(str(CKPT), resident=k, device="cpu", dtype=torch.float32, progress=False)
    prompt = torch.tensor([encode("def read_config(path):\n    with open(path) as f:\n        ")])
    kw = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=PAD)
    with torch.no_grad():
        assert torch.equal(paged(prompt).logits, ref(prompt).logits)
        a, b = paged.generate(prompt, **kw), ref.generate(prompt, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    total = moepage.stats(paged).total
    assert total.misses > 0 and total.hits > 0, "K < E: the run must have paged experts in and reused some"
