"""Recording the routing of an HF MoE model as a ``moepage.planning.traces.Trace``.

``RoutingRecorder`` hooks every routed experts module (as ``moepage.find_experts`` finds them, wrapped by moepage or
not) and keeps the expert ids each call is given (``top_k_index``), so the i-th call of every layer is step i of the
trace: a ``generate`` of N new tokens is N steps, its prefill call then N - 1 decode calls. The hooks only read their
input, so outputs are unchanged, and they are removed on exit, error or not. ``record_routing`` runs greedy generation
over prompts under one; ``record_checkpoint`` loads a checkpoint directory for ``moepage record``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from ...errors import ConfigError
from ...nn.find import as_device, find_experts
from ...nn.layer import paged_layer

Prompt = Sequence[int] | torch.Tensor  # token ids [T], or a batch [B, T] of prompts of one length (no padding)


def _routing_arg(module: nn.Module) -> str:
    """The name of the forward's routing parameter (``top_k_index`` in transformers; gpt-oss: ``router_indices``)."""
    params = list(inspect.signature(type(module).forward).parameters)  # follows transformers' @wraps to the original
    return params[2] if len(params) > 2 else "top_k_index"


def _num_experts(module: nn.Module) -> int:
    layer = paged_layer(module)
    if layer is not None:  # a paged module's parameters are its K slots
        return layer.num_experts
    declared = getattr(module, "num_experts", None)
    return declared if isinstance(declared, int) else next(module.parameters()).shape[0]


class RoutingRecorder:
    """``with RoutingRecorder(model) as rec: model.generate(...)``, then ``rec.trace()``. Call ``mark_prefill()``
    before each prefill call (``record_routing`` does) so the trace knows its prefill steps."""

    def __init__(self, model: nn.Module):
        found = find_experts(model)
        if not found:
            kind = type(model).__name__
            raise ConfigError(f"{kind} has no routed experts module (stacked expert weights and a forward taking "
                              "hidden_states, top_k_index, top_k_weights): nothing to record")
        self.names = [name for name, _ in found]
        self.modules = [module for _, module in found]
        sizes = {name: _num_experts(m) for name, m in found}
        if len(set(sizes.values())) != 1:
            raise ConfigError(f"the experts modules disagree on the number of experts ({sizes}); a trace has one E")
        self.num_experts = next(iter(sizes.values()))
        self.calls: list[list[torch.Tensor]] = [[] for _ in found]  # calls[l][t]: [tokens, k] ids of call t
        self.prefill_steps: list[int] = []
        self._handles: list = []

    def __enter__(self) -> RoutingRecorder:
        try:
            for l, module in enumerate(self.modules):
                self._handles.append(module.register_forward_pre_hook(self._hook(l, _routing_arg(module)),
                                                                      with_kwargs=True))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, l: int, name: str) -> Callable:
        def read(module, args, kwargs):
            ids = args[1] if len(args) > 1 else kwargs[name]
            # A copy on the ids' device: no sync per layer; the host reads them once, in trace().
            self.calls[l].append(ids.detach().reshape(-1, ids.shape[-1]).clone())

        return read

    @property
    def num_steps(self) -> int:
        return len(self.calls[0])

    def mark_prefill(self) -> None:
        """The next call is a prefill."""
        self.prefill_steps.append(self.num_steps)

    def steps(self) -> list[torch.Tensor]:
        """Per step, ``[layers, tokens * k]`` int64 ids on the CPU (ids outside 0..E-1, as transformers' expert-parallel
        sentinel E, become -1: not routed here)."""
        counts = {name: len(c) for name, c in zip(self.names, self.calls)}
        if len(set(counts.values())) != 1:
            raise ConfigError(f"the experts modules ran different numbers of times ({counts}); every MoE layer "
                              "must run once per forward call to make trace steps")
        out = []
        for t in range(self.num_steps):
            rows = [c[t].reshape(-1).long().cpu() for c in self.calls]
            width = max(r.numel() for r in rows)
            step = torch.full((len(rows), width), -1, dtype=torch.long)
            for l, r in enumerate(rows):
                step[l, : r.numel()] = torch.where((r >= 0) & (r < self.num_experts), r, -1)
            out.append(step)
        return out

    @property
    def top_k(self) -> int:
        return int(self.calls[0][0].shape[-1]) if self.num_steps else 0

    def trace(self, name: str = "recorded"):
        """The recorded steps as a ``Trace`` (needs numpy: the traces extra)."""
        from ...planning.traces import from_steps

        if not self.num_steps:
            raise ValueError(f"{name}: nothing was recorded (no forward call ran under the recorder)")
        steps = [s.numpy() for s in self.steps()]
        return from_steps(name, steps, self.num_experts, self.top_k, self.prefill_steps)


def _as_batch(prompt: Prompt, index: int, device: torch.device) -> torch.Tensor:
    ids = prompt if isinstance(prompt, torch.Tensor) else torch.tensor(list(prompt), dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.numel() == 0 or ids.is_floating_point():
        raise ConfigError(f"prompt {index + 1}: expected token ids [T] or [B, T] (integers, not empty), "
                          f"got {ids.dtype} of shape {tuple(ids.shape)}")
    return ids.to(device)


def record_routing(model: nn.Module, prompts: Iterable[Prompt], max_new_tokens: int = 16, *, name: str = "recorded",
                   progress: Callable[[str], None] | None = None, **generate_kwargs):
    """The routing of greedy ``model.generate`` over ``prompts`` (each token ids ``[T]``, or ``[B, T]`` of one
    length), one after another, as a ``Trace``: per prompt its prefill step then one step per further new token
    (fewer if it stops at EOS). ``progress`` gets a line of text after each prompt.
    ``generate_kwargs`` go to ``generate`` (``do_sample=False`` and a pad id unless given)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    device = next(model.parameters()).device
    batches = [_as_batch(p, i, device) for i, p in enumerate(prompts)]
    if not batches:
        raise ConfigError("no prompts to record")
    config = getattr(model, "generation_config", None)
    pad = next((x for x in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None))
                if x is not None), 0)
    kwargs = dict(do_sample=False, pad_token_id=pad[0] if isinstance(pad, list) else pad, **generate_kwargs)
    recorder = RoutingRecorder(model)
    with recorder, torch.no_grad():
        for i, ids in enumerate(batches):
            recorder.mark_prefill()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **kwargs)
            if progress is not None:
                progress(f"prompt {i + 1}/{len(batches)}: {ids.shape[-1]} tokens in, "
                         f"{recorder.num_steps - recorder.prefill_steps[-1]} steps recorded")
    return recorder.trace(name)


DTYPES = ("auto", "float32", "bfloat16", "float16")


# What a saved tokenizer is made of: transformers' tokenizer.json / tokenizer_config.json, or an older one's vocabulary
# (vocab.json, vocab.txt) or sentencepiece model. With none, transformers builds an empty tokenizer, not an error.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.*", "*.model")


def _has_tokenizer_files(path: Path) -> bool:
    return any(next(path.glob(pattern), None) is not None for pattern in TOKENIZER_FILES)


def _no_tokenizer(path: str | os.PathLike, why: str) -> str:
    return f"{path}: no usable tokenizer for text prompts: {why}; give token ids instead (--token-ids FILE)"


def record_checkpoint(path: str | os.PathLike, prompts: Sequence[str] | Sequence[Sequence[int]], *,
                      max_new_tokens: int = 16, device: str | None = None, dtype: str = "auto",
                      progress: Callable[[str], None] | None = None):
    """Load the HF checkpoint directory ``path`` (``AutoModelForCausalLM``) on ``device`` (default: CUDA when
    available) and ``record_routing`` it over ``prompts``: texts (tokenised by the checkpoint's tokenizer) or token id
    lists (no tokenizer needed). Inputs are checked before the weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    target = as_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if not os.path.isdir(path):  # never a hub id: transformers would ask the hub, slowly, for a mistyped folder
        raise ConfigError(f"{path}: no such checkpoint directory; pass a local Hugging Face checkpoint directory")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a Hugging Face checkpoint directory (config.json): {exc}") from None
    texts = sum(isinstance(p, str) for p in prompts)
    if not prompts or 0 < texts < len(prompts):
        raise ConfigError(f"prompts must be all texts or all token id lists, got {texts} texts of {len(prompts)}")
    if not texts:
        vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", 0)
        for i, ids in enumerate(prompts):
            if vocab and any(x >= vocab for x in ids):
                raise ConfigError(f"prompt {i + 1}: token id {max(ids)} is outside the model's vocabulary "
                                  f"0..{vocab - 1} ({path})")
        batches: list[Prompt] = [list(ids) for ids in prompts]
    else:
        from transformers import AutoTokenizer

        if Path(path).is_dir() and not _has_tokenizer_files(Path(path)):
            raise ConfigError(_no_tokenizer(path, "the checkpoint directory has no tokenizer files "
                                            f"({', '.join(TOKENIZER_FILES)})"))
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(_no_tokenizer(path, f"{type(exc).__name__}: {str(exc)[:120]}")) from None
        if len(tokenizer) <= 1:  # files there, but a vocabulary of its unknown token at most
            raise ConfigError(_no_tokenizer(path, "its tokenizer files give an empty vocabulary"))
        batches = [tokenizer(text, return_tensors="pt").input_ids for text in prompts]
        if empty := [i + 1 for i, ids in enumerate(batches) if ids.numel() == 0]:
            raise ConfigError(f"{path}: the tokenizer gives no tokens for prompts {empty}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    model = model.to(target).eval()
    return record_routing(model, batches, max_new_tokens, name=Path(path).name, progress=progress)
