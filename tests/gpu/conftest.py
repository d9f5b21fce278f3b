"""Everything in this folder runs on a CUDA GPU: marked ``gpu`` and skipped, saying why, where
there is none (``pytest -m gpu`` selects these on a GPU machine)."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
