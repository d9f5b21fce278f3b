"""Integrations with model libraries (``transformers``, ``sglang``): each imported on its own, never by the core."""
