"""``CheckpointFill``: ``from_pretrained``'s loader (``wrap``'s ``load=``), reading a safetensors checkpoint tensor by
tensor into a model built on the meta device: routed experts into the store's rows (over a disk tier read in place,
or an earlier load's kept layout adopted), every other weight onto the device, converted as transformers converts it
on load; then tied weights and fresh buffers (``finish``)."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ...backends import layouts
from ...backends.disk import identities
from ...backends.protocol import KeptLayouts, PagedExpertStore, RowsOnDisk
from ...config import listed
from ...errors import ConfigError
from . import checkpoint as ckpt


@dataclass
class CheckpointFill:
    """Reads ``files`` (file -> its keys; ``headers``: their safetensors headers) of the checkpoint at ``path`` into
    ``model`` (built on the meta device; ``meta_keys``: its state dict's keys) and the store wrap allocated. Its
    weights go to ``device`` in the model's dtype (float32 where ``keep_fp32`` matches); ``coded``: the expert rows
    read are staged to be coded; ``progress``: a bar over the tensors."""

    path: str
    model: nn.Module
    files: dict[str, list[str]]
    headers: dict
    meta_keys: set[str]
    device: torch.device
    keep_fp32: re.Pattern | None
    coded: bool
    progress: bool

    def __call__(self, store: PagedExpertStore, layers: dict) -> None:
        router = ckpt.KeyRouter(self.model, layers, self.meta_keys)
        conversions = ckpt.Conversions(router)
        seen: dict = {}
        experts = {layer: self.model.get_submodule(layer)._parameters[next(iter(specs))].shape[0]
                   for layer, specs in layers.items()}
        # A disk tier: expert rows read in place, or the layout an earlier load kept of them reused.
        disk = isinstance(store, RowsOnDisk) and isinstance(store, KeptLayouts)
        source = layouts.source_of(files=identities(self.files), rows=layers) if disk else None
        what = f"{self.path}'s expert rows on disk"
        reused = disk and layouts.adopt(store, source, what, found=False)  # (rows found damaged drop it)
        unexpected = self._read(store, router, conversions, seen, experts, reused, disk)
        for name, tensor in conversions.converted(self.model).items():
            if name not in self.meta_keys:
                unexpected.append(name)
                continue
            self._load_tensor(name, name, tensor)
        if not reused and (missing := ckpt.missing_rows(layers, experts, seen)):
            raise ConfigError(f"{self.path}: the checkpoint lacks routed expert weights: {', '.join(missing)}")
        if disk and not reused:
            layouts.keep(store, source, what)
        finish(self.model, self.device, set(router.experts))
        if unexpected:
            warnings.warn(f"{self.path}: {len(unexpected)} checkpoint keys unused by the model: {listed(unexpected)}",
                          stacklevel=1)

    def _read(self, store: PagedExpertStore, router, conversions, seen: dict, experts: dict[str, int], reused: bool,
              disk: bool) -> list[str]:
        """Every tensor of the checkpoint to where it goes (expert rows not at all where an earlier layout is
        reused), with a bar; the keys the model does not use."""
        from safetensors import safe_open
        from tqdm.auto import tqdm

        offsets = {file: {info.name: info.offset for info in infos} for file, infos in self.headers.items()}
        unexpected: list[str] = []
        bar = tqdm(total=sum(map(len, self.files.values())), desc="moepage: loading", unit="tensor",
                   disable=not self.progress)
        rows = "raw expert rows" if self.coded else "expert rows"  # (coded: what is staged to be coded, or kept)
        if reused:  # said where a user looks (the log may not be set up): this start reads no expert tensor
            bar.set_postfix_str(f"{rows} reused from {store.spill_dir}: 0 written", refresh=False)
        try:
            for file, keys in self.files.items():
                with safe_open(file, framework="pt", device="cpu") as reader:
                    for key in sorted(keys):
                        name, piece, pattern = router.route(key)
                        if piece is not None:
                            if not reused:
                                ckpt.write_piece(store, piece, reader, key, seen, experts[piece.layer],
                                                 at=(file, offsets[file][key]))
                        elif pattern is not None:  # a non-expert tensor transformers converts
                            conversions.add(name, key, pattern, reader.get_tensor(key))
                        elif name in self.meta_keys:
                            self._load_tensor(name, key, reader.get_tensor(key))
                        else:
                            unexpected.append(key)
                        bar.update(1)
            if disk and not reused:
                in_place, written = store.tally()
                bar.set_postfix_str(f"{rows}: {in_place} read in place, {written} written to {store.spill_dir}",
                                    refresh=False)
        finally:
            bar.close()
        return unexpected

    def _load_tensor(self, name: str, key: str, tensor: torch.Tensor) -> None:
        """Put checkpoint tensor ``key`` (as model key ``name``) into the model on the device, in the model's dtype
        (float32 where the model keeps it so), as an owned, aligned copy."""
        target = _get(self.model, name)
        fp32 = self.keep_fp32 is not None and self.keep_fp32.search(name)
        want = torch.float32 if fp32 else target.dtype
        if tuple(tensor.shape) != tuple(target.shape):
            raise ConfigError(f"checkpoint key {key!r}: shape {tuple(tensor.shape)}, "
                              f"model {name} has {tuple(target.shape)}")
        _set_tensor(self.model, name, tensor.to(device=self.device, dtype=want, copy=True))


def _get(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, attr)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if attr in module._buffers:
        module._buffers[attr] = value
    else:
        param = nn.Parameter(value, requires_grad=False)  # inference only: see from_pretrained
        param._is_hf_initialized = True
        module._parameters[attr] = param


def finish(model: nn.Module, device: torch.device, expert_keys: set[str]) -> None:
    """Tie weights, build the non-persistent buffers (rotary tables) as transformers does, and
    check that nothing but the routed experts is left on the meta device."""
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    fresh = set()
    for module in model.modules():
        for n, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[n] = torch.empty_like(b, device=device)
                fresh.add(id(module._buffers[n]))
        for p in module._parameters.values():
            if p is not None:
                p._is_hf_initialized = True  # loaded (or an expert parameter): never re-initialised
        for b in module._buffers.values():
            if b is not None and id(b) not in fresh:
                b._is_hf_initialized = True
        if not any(id(b) in fresh for b in module._buffers.values() if b is not None):
            module._is_hf_initialized = True
    if fresh and hasattr(model, "initialize_weights"):
        model.initialize_weights()  # only the modules owning fresh buffers (rotary: inv_freq)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.is_meta and n not in expert_keys]
    if left:
        raise ConfigError(f"the checkpoint lacks weights for {listed(left, 8)}")
