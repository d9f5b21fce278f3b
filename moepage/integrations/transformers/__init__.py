"""Hugging Face transformers (v5) integration: check, wrap and load MoE models with paged experts.

    from moepage.integrations import transformers as mhf
    mhf.wrap(model, resident=K)                       # an HF model already in memory
    model = mhf.from_pretrained(path, resident=K, device="cuda", dtype=torch.bfloat16)

``runners`` registers transformers' experts implementations as moepage runners (an entry point)."""

from .check import check_supported, wrap
from .loader import from_pretrained

__all__ = ["check_supported", "from_pretrained", "wrap"]
