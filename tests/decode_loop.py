"""A static-cache greedy decode loop for Hugging Face models, as serving engines run it: one eager
prefill of a left-padded batch, then decode steps of fixed shapes that can be captured once in a
CUDA graph and replayed (a replay runs no Python), with inputs written into static buffers.

``greedy(model, prompts, new_tokens, graph)`` returns the generated tokens and every step's
logits; with ``graph`` the decode step is captured after one eager warm-up step, both under
``moepage.capture_mode()``. Used by the GPU tests (captured) and the CPU tests (eager)."""

from __future__ import annotations

import torch

import moepage


def left_padded(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


@torch.no_grad()
def greedy(model, prompts: list[list[int]], new_tokens: int, graph: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from transformers import StaticCache

    device = next(model.parameters()).device
    ids, mask = left_padded(prompts, 0, device)
    b, width = ids.shape
    length = width + new_tokens + 1
    cache = StaticCache(config=model.config, max_cache_len=length)
    full_mask = torch.zeros(b, length, dtype=mask.dtype, device=device)  # static: updated in place
    full_mask[:, :width] = mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=full_mask, position_ids=positions, past_key_values=cache,
                cache_position=torch.arange(width, device=device), use_cache=True)
    logits = [out.logits[:, -1].float().clone()]
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    # The decode step's inputs, in static buffers. Its mask is a prepared 4D additive one, which
    # transformers passes through as is: building one inside the step copies host scalars, which
    # a capture cannot.
    step_ids = token.clone()
    step_pos = positions[:, -1:] + 1
    step_cache_pos = torch.full((1,), width, dtype=torch.long, device=device)
    dtype = model.get_input_embeddings().weight.dtype
    blocked = torch.finfo(dtype).min
    step_mask = torch.full((b, 1, 1, length), blocked, dtype=dtype, device=device)
    step_mask[:, 0, 0, :width] = torch.where(mask.bool(), 0.0, blocked).to(dtype)

    def step() -> torch.Tensor:
        return model(input_ids=step_ids, attention_mask=step_mask, position_ids=step_pos, past_key_values=cache,
                     cache_position=step_cache_pos, use_cache=True).logits[:, -1]

    generated = [token]
    captured, result = None, None
    for i in range(new_tokens):
        step_mask[:, 0, 0, width + i] = 0  # the step's own token
        if graph and i == 0:
            with moepage.capture_mode():  # the warm-up takes the path the capture will
                step_logits = step()
        elif graph:
            if captured is None:
                captured = torch.cuda.CUDAGraph()
                with moepage.capture_mode(), torch.cuda.graph(captured):
                    result = step()
            captured.replay()
            step_logits = result
        else:
            step_logits = step()
        logits.append(step_logits.float().clone())
        token = step_logits.argmax(-1, keepdim=True)
        generated.append(token)
        step_ids.copy_(token)
        step_pos += 1
        step_cache_pos += 1
    return torch.cat(generated, dim=1), logits
