"""Hugging Face transformers (v5) integration: load MoE models with paged experts, and check which can be paged.

    from moepage.integrations import transformers as mhf
    model = mhf.from_pretrained(path, resident=K, device="cuda", dtype=torch.bfloat16)
    moepage.wrap(model, resident=K)                   # an HF model already in memory

``runners`` registers transformers' experts implementations as moepage runners, and the diagnosis ``moepage.wrap``
gives for a model it cannot page (an entry point)."""

from .check import check_supported
from .loader import from_pretrained

__all__ = ["check_supported", "from_pretrained"]
