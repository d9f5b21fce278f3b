"""CUDA-graph paths of paged SGLang layers.

- Decode graphs (full backend) capture every batch size: a decode step of more than K routed
  entries runs a fixed number of device-planned waves (``step.PagedExperts.device_forward``).
  SGLang's runner warms each batch size up in capture mode before capturing it; moepage plans on
  the device there too (``moepage.capture_mode``), so the kernels are built before the capture.
- Host-planned steps under the breakable prefill graph run as an eager break between captured
  segments (``eager_break``): flat tensors in, the output buffer filled in place, so a replay
  re-runs the waves on the routing of that step. During capture itself the routing is not
  computed yet, so the break's body is skipped then (warm-up and replay run it).
"""

from __future__ import annotations

import torch


def decode_graphs_full() -> bool:
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend

    return check_cuda_graph_backend(Phase.DECODE, Backend.FULL)


def graphs_disabled() -> bool:
    from sglang.srt.model_executor.cuda_graph_config import cuda_graph_fully_disabled

    return cuda_graph_fully_disabled()


def sglang_capture_mode() -> bool:
    """Whether SGLang's graph runner is warming up or capturing a graph (``model_capture_mode``),
    or running under the breakable prefill graph."""
    try:
        from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode
    except ImportError:  # pragma: no cover
        return False
    return bool(get_is_capture_mode())


def in_breakable_graph() -> bool:
    try:
        from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context import (
            is_in_breakable_cuda_graph,
        )
    except ImportError:  # pragma: no cover
        return False
    return bool(is_in_breakable_cuda_graph())


def _skip_during_capture(*args, **kwargs) -> None:
    return None


def eager_break(fn):
    """``fn(self, layer, hidden, topk_weights, topk_ids, router_logits, out)`` as an eager break
    of SGLang's breakable CUDA graph (a plain call outside one)."""
    try:
        from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import eager_on_graph
    except ImportError:  # pragma: no cover
        return fn
    return eager_on_graph(True, capture_stub=_skip_during_capture)(fn)


def standard_dispatch(hidden: torch.Tensor, topk_weights, topk_ids, router_logits):
    """Rebuild the dispatch output a break was captured with, from its flat tensors."""
    from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    return StandardDispatchOutput(
        hidden_states=hidden,
        hidden_states_scale=None,
        topk_output=StandardTopKOutput(topk_weights=topk_weights, topk_ids=topk_ids, router_logits=router_logits),
    )
