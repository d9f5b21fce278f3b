"""Integrations of moepage with model libraries. Each is imported on its own, never by the core:

    from moepage.integrations import transformers as mhf   # Hugging Face transformers (v5)
"""
