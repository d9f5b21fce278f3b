"""Hugging Face transformers (v5) integration: check, wrap and load MoE models with paged experts.

    from moepage.integrations import transformers as mhf

    mhf.wrap(model, resident=K)                       # an HF model already in memory
    model = mhf.from_pretrained(path, resident=K, device="cuda", dtype=torch.bfloat16)

Modules: ``check`` (which models can be paged), ``loader`` (``from_pretrained``), ``checkpoint``
(reading safetensors keys through transformers' conversion mapping), ``runners`` (transformers'
experts implementations as moepage runners, registered through an entry point).
"""

from .check import check_supported, wrap
from .loader import from_pretrained

__all__ = ["check_supported", "from_pretrained", "wrap"]
