"""A static-cache greedy decode loop for HF models, as serving engines run it: one eager prefill of a left-padded
batch, then fixed-shape decode steps on static buffers, which a CUDA graph can capture once and replay (no Python).
``greedy`` returns the tokens and every step's logits; with ``graph`` its steps go through ``StaticDecode.graph_step``
(one eager warm-up step, then one capture replayed, both under ``moepage.capture_mode()``). A capture records kernels
without running them, so the warm-up must be a real step: a sliding-window layer rolls its keys at every call, so
running a step twice is not running it once.

Sliding-window layers keep the last W keys, rolled from the step where the window fills (a host counter of
transformers decides it at each call); each gets a step mask of its W slots (by ``layer_types``, or the one mask of
a model whose every layer slides). A full window rolls with an index tensor made from the host at every step, which
a CUDA graph cannot record: ``graph_step`` needs windows no narrower than the cache, and ``step`` serves the rest."""

from __future__ import annotations

import torch

from ...capture import capture_mode
from ...errors import ConfigError


def left_padded(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


class StaticDecode:
    """``prompts`` (left-padded) in a static cache of ``width + new_tokens + 1`` positions; the decode step's inputs
    in static buffers. The step's mask is a prepared 4D additive one (transformers passes it through; building one in
    the step copies host scalars, which a capture cannot). Nothing reads the device on the host: no syncs."""

    def __init__(self, model, prompts: list[list[int]], new_tokens: int):
        from transformers import StaticCache

        self.model = model
        device = next(model.parameters()).device
        self.ids, self.mask = left_padded(prompts, 0, device)
        b, self.width = self.ids.shape
        self.length = length = self.width + new_tokens + 1
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        self.full_mask = torch.zeros(b, length, dtype=self.mask.dtype, device=device)
        self.full_mask[:, : self.width] = self.mask
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        dtype = model.get_input_embeddings().weight.dtype
        self.blocked = torch.finfo(dtype).min
        self.step_ids = torch.zeros(b, 1, dtype=torch.long, device=device)
        self.step_pos = self.positions[:, -1:] + 1
        self.step_cache_pos = torch.full((1,), self.width, dtype=torch.long, device=device)
        self.step_mask = torch.full((b, 1, 1, length), self.blocked, dtype=dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None  # graph_step's capture, and its static logits
        self.graph_logits: torch.Tensor | None = None
        self.warmed = False
        self.window, self.by_type = _sliding_window(model.config, self.cache)
        self.window_mask = (None if self.window is None
                            else torch.full((b, 1, 1, self.window), self.blocked, dtype=dtype, device=device))

    def prefill(self) -> torch.Tensor:
        """Run the prompts into the cache, emptied in place first (transformers' static layers may place keys by a
        device-side counter; addresses kept: a captured step stays valid); reset the step; return the last logits."""
        self.cache.reset()
        out = self.model(input_ids=self.ids, attention_mask=self.full_mask, position_ids=self.positions,
                         past_key_values=self.cache, cache_position=torch.arange(self.width, device=self.ids.device),
                         use_cache=True)
        self.step_mask.fill_(self.blocked)
        self.step_mask[:, 0, 0, : self.width] = torch.where(
            self.mask.bool(), 0.0, self.blocked).to(self.step_mask.dtype)
        return out.logits[:, -1]

    def feed(self, i: int, token: torch.Tensor) -> None:
        """Decode step ``i``'s inputs: ``token [B, 1]`` at cache position ``width + i``."""
        self.step_mask[:, 0, 0, self.width + i] = 0  # the step's own token
        self.step_ids.copy_(token)
        torch.add(self.positions[:, -1:], i + 1, out=self.step_pos)
        self.step_cache_pos.fill_(self.width + i)
        if self.window_mask is not None:  # slot j holds column start + j once the window has filled
            start = max(0, self.width + i + 1 - self.window)
            self.window_mask.copy_(self.step_mask[..., start: start + self.window])

    def step_attention_mask(self) -> torch.Tensor | dict[str, torch.Tensor]:
        """The step's 4D mask: per layer type where some layers slide, the window's where all do."""
        if self.window_mask is None:
            return self.step_mask
        if not self.by_type:
            return self.window_mask
        return {"full_attention": self.step_mask, "sliding_attention": self.window_mask}

    def step(self) -> torch.Tensor:
        """The decode step on the static buffers: logits ``[B, V]`` (capturable)."""
        return self.model(input_ids=self.step_ids, attention_mask=self.step_attention_mask(),
                          position_ids=self.step_pos, past_key_values=self.cache,
                          cache_position=self.step_cache_pos, use_cache=True).logits[:, -1]


    def graph_step(self) -> torch.Tensor:
        """The decode step through one CUDA graph: the first call is a real warm-up step on the capture's path (in
        ``moepage.capture_mode``), the second captures the step and replays it, later ones replay it, prefills in
        between included. Each call is one step (a capture runs nothing, so it is never counted as one)."""
        if self.window is not None and self.window < self.length:
            raise ConfigError(
                f"StaticDecode.graph_step: the model's sliding-window layers keep {self.window} keys, fewer than this "
                f"decode's {self.length} positions; a full window rolls with a tensor made from the host at every "
                "step, which a CUDA graph cannot record. Decode with step(), or with a sliding_window of at least "
                f"{self.length}")
        if not self.warmed:
            self.warmed = True
            with capture_mode():
                return self.step()
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with capture_mode(), torch.cuda.graph(self.graph):
                self.graph_logits = self.step()
        self.graph.replay()
        return self.graph_logits


def _sliding_window(config, cache) -> tuple[int | None, bool]:
    """(key slots of the cache's sliding-window layers, whether the model takes a mask per layer type); (None, False)
    without such layers. Masks this loop cannot prepare (chunked attention, windows of several sizes) are refused."""
    layers = list(getattr(cache, "layers", []))
    sliding = [i for i, layer in enumerate(layers) if getattr(layer, "is_sliding", False)]
    if not sliding:
        return None, False
    sizes = sorted({int(layers[i].max_cache_len) for i in sliding})
    if len(sizes) > 1:
        raise ConfigError(f"StaticDecode: sliding-window layers of several sizes {sizes} are not supported")
    types = getattr(config.get_text_config(decoder=True), "layer_types", None)
    if types:
        other = sorted({types[i] for i in sliding if i < len(types) and types[i] != "sliding_attention"})
        if other:
            raise ConfigError(f"StaticDecode: layers of type {other} keep a window cache whose mask this loop cannot "
                              "prepare (it serves full_attention and sliding_attention)")
        return sizes[0], True
    if len(sliding) != len(layers):
        raise ConfigError("StaticDecode: some layers slide and some do not, and the config names no layer_types")
    return sizes[0], False


@torch.no_grad()
def greedy(model, prompts: list[list[int]], new_tokens: int,
           graph: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    dec = StaticDecode(model, prompts, new_tokens)
    first = dec.prefill()
    logits = [first.float().clone()]
    token = first.argmax(-1, keepdim=True)
    generated = [token]
    for i in range(new_tokens):
        dec.feed(i, token)
        step_logits = dec.graph_step() if graph else dec.step()
        logits.append(step_logits.float().clone())
        token = step_logits.argmax(-1, keepdim=True)
        generated.append(token)
    return torch.cat(generated, dim=1), logits
