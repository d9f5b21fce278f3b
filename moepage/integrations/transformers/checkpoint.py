"""A local safetensors checkpoint read tensor by tensor for ``from_pretrained``, keys mapped to model parameters
through transformers' own conversion mapping (its renamings and ``WeightConverter`` s). An expert tensor goes straight
into its host row: a stacked ``[E, ...]`` key one expert at a time, a per-expert key (``...experts.3.gate_proj.weight``,
merged by ``MergeModulelist(dim=0)`` [+ ``Concatenate(dim=1)``]) into its part of row 3; no ``[E, ...]`` is built."""

from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import dataclass

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)

from ...backends.disk import aligned
from ...errors import ConfigError
from ...nn.find import find_experts
from ...planning.sizing import TensorInfo, read_header, read_index

# A safetensors header's dtype names, as torch's (where this torch has them).
SAFETENSORS_DTYPES = {name: getattr(torch, attr) for name, attr in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"), ("I64", "int64"), ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"),
    ("BOOL", "bool")) if hasattr(torch, attr)}


def checkpoint_files(path: str) -> dict[str, list[str]]:
    """``{safetensors file: [keys]}`` of a local checkpoint directory (sharded or not). Every header is checked first
    (no data read), so a truncated or corrupt file is a ``ConfigError`` naming it before anything is allocated."""
    if not os.path.isdir(path):
        raise ConfigError(
            f"{path!r} is not a local directory; moepage's loader reads local safetensors checkpoints "
            "(download one first, e.g. huggingface_hub.snapshot_download)"
        )
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_index(index)
        files: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            files.setdefault(os.path.join(path, name), []).append(key)
        for file in files:
            if not os.path.isfile(file):
                raise ConfigError(f"{index} names {file}, which is missing: download it")
            read_header(file)
        return files
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise ConfigError(f"{path!r} has no model.safetensors(.index.json): moepage loads safetensors only")
    return {single: [t.name for t in read_header(single)]}


@dataclass(frozen=True)
class ExpertPiece:
    """Where one checkpoint tensor goes in the host store."""

    layer: str  # store layer key (the experts module's qualified name)
    param: str  # parameter name in the experts module
    expert: int | None  # None: a stacked [E, ...] tensor (every row)
    part: int = 0  # which of ``parts`` concatenated pieces of the row (dim 0 of the row)
    parts: int = 1


class KeyRouter:
    """Maps checkpoint keys to model parameter names or to ``ExpertPiece`` s."""

    def __init__(self, model: torch.nn.Module, layers: dict[str, dict], meta_keys: set[str]):
        mapping = get_model_conversion_mapping(model)
        self.renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        self.converters = [t for t in mapping if isinstance(t, WeightConverter)]
        self.by_pattern = {p: c for c in self.converters for p in c.source_patterns}
        self.prefix = getattr(model, "base_model_prefix", None)
        self.meta_keys = dict.fromkeys(meta_keys, True)  # transformers looks keys up with .get
        self.experts = {f"{layer}.{param}": (layer, param) for layer, specs in layers.items() for param in specs}

    def route(self, key: str) -> tuple[str, ExpertPiece | None, str | None]:
        """``(model key, piece, pattern)``: piece None for a non-expert tensor, pattern its converter's (or None)."""
        renamed, pattern = rename_source_key(key, self.renamings, self.converters, self.prefix, self.meta_keys)
        if renamed not in self.meta_keys and key in self.meta_keys:  # as transformers does
            renamed, pattern = rename_source_key(key, [], [], self.prefix, self.meta_keys)
        target = self.experts.get(renamed)
        if target is None:
            return renamed, None, pattern
        if pattern is None:
            return renamed, ExpertPiece(*target, expert=None), None
        conv = self.by_pattern[pattern]
        ops = list(conv.operations)
        merge = [op for op in ops if isinstance(op, MergeModulelist)]
        cat = [op for op in ops if isinstance(op, Concatenate)]
        if len(merge) != 1 or merge[0].dim != 0 or len(ops) != 1 + len(cat) or any(op.dim != 1 for op in cat):
            raise ConfigError(
                f"checkpoint key {key!r} -> {renamed}: conversion {[type(op).__name__ for op in ops]} is not "
                "supported by moepage's loader (it writes MergeModulelist(dim=0) [+ Concatenate(dim=1)] per expert)"
            )
        # The pattern is a regex whose "*." stands for the expert index (transformers reads it so).
        match = re.search(pattern.replace("*.", r"(\d+)\."), key)
        if match is None:
            raise ConfigError(f"checkpoint key {key!r}: no expert index where {pattern!r} has '*'")
        parts = len(conv.source_patterns) if cat else 1
        part = conv.source_patterns.index(pattern) if cat else 0
        return renamed, ExpertPiece(*target, expert=int(match.group(1)), part=part, parts=parts), None

    def conversion(self, pattern: str) -> WeightConverter:
        """A fresh copy of the transformers converter that ``pattern`` belongs to."""
        return copy.deepcopy(self.by_pattern[pattern])


class Conversions:
    """Non-expert tensors that transformers converts on load (concatenates, splits, ...), gathered per target and
    converted with its own ``WeightConverter`` once all are read."""

    def __init__(self, router: KeyRouter):
        self.router = router
        self.pending: dict[str, WeightConverter] = {}

    def add(self, target: str, key: str, pattern: str, tensor: torch.Tensor) -> None:
        converter = self.pending.setdefault(target, self.router.conversion(pattern))
        converter.add_tensor(target, key, pattern, lambda: tensor)

    def converted(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``{model key: tensor}`` of every converted target."""
        out: dict[str, torch.Tensor] = {}
        for target, converter in self.pending.items():
            try:
                out.update(converter.convert(target, model=model, config=getattr(model, "config", None)))
            except Exception as exc:  # noqa: BLE001 - named with the key it was converting
                raise ConfigError(f"converting checkpoint tensors into {target!r} failed: {exc}") from exc
        return out


def write_piece(store, piece: ExpertPiece, reader, key: str, seen: dict, num_experts: int,
                at: tuple[str, int] | None = None) -> None:
    """Write one checkpoint tensor into its host rows (``store.place_row``: cast to the rows' dtype), one expert at a
    time, and record it in ``seen[(layer, param)] = [parts, {(expert, part), ...}]``. ``at`` = (file, data offset) of
    the key: a store keeping rows on disk reads them from there, in place."""
    parts, done = seen.setdefault((piece.layer, piece.param), [piece.parts, set()])
    if parts != piece.parts:
        raise ConfigError(f"checkpoint key {key!r}: {piece.layer}.{piece.param} is stored both stacked and per expert")
    e = num_experts
    row_shape = tuple(store.slots(piece.layer, piece.param).shape[1:])
    if piece.expert is None:
        view = reader.get_slice(key)
        shape = tuple(view.get_shape())
        if shape != (e, *row_shape):
            raise ConfigError(f"checkpoint key {key!r}: shape {shape}, expected {(e, *row_shape)}")
        for j in range(e):
            row = view[j]
            where = None if at is None else (at[0], at[1] + j * row.numel() * row.element_size())
            store.place_row(piece.layer, piece.param, j, row, at=where)
            done.add((j, 0))
        return
    if not 0 <= piece.expert < e:
        raise ConfigError(f"checkpoint key {key!r}: expert {piece.expert} outside 0..{e - 1}")
    tensor = reader.get_tensor(key)
    if piece.parts > 1:
        size = row_shape[0] // piece.parts
        if size * piece.parts != row_shape[0]:
            raise ConfigError(f"checkpoint key {key!r}: cannot split rows of {row_shape} in {piece.parts}")
        row_shape = (size, *row_shape[1:])
    if tuple(tensor.shape) != row_shape:
        raise ConfigError(f"checkpoint key {key!r}: shape {tuple(tensor.shape)}, expected {row_shape}")
    store.place_row(piece.layer, piece.param, piece.expert, tensor, part=piece.part, parts=piece.parts, at=at)
    done.add((piece.expert, piece.part))


def written_bytes(model: torch.nn.Module, headers: dict[str, list[TensorInfo]], meta_keys: set[str]) -> int:
    """Bytes ``write_piece`` writes into a disk tier's folder: each routed expert tensor of the checkpoint
    (``headers``: each file's tensors) of another dtype than its parameter in ``model`` (built on the meta device, as
    loaded) is cast and written a row, or a row's part, at a time, each at a 4 KiB boundary (``disk.aligned``); the
    others are read in place."""
    router = KeyRouter(model, {q: dict(m._parameters) for q, m in find_experts(model)}, meta_keys)
    total = 0
    for infos in headers.values():
        for info in infos:
            piece = router.route(info.name)[1]
            param = None if piece is None else model.get_submodule(piece.layer)._parameters[piece.param]
            if param is not None and SAFETENSORS_DTYPES.get(info.dtype) != param.dtype:
                rows = info.shape[0] if piece.expert is None and info.shape else 1
                total += rows * aligned(math.prod(info.shape) // max(rows, 1) * param.element_size())
    return total


def missing_rows(layers: dict[str, dict], experts: dict[str, int], seen: dict) -> list[str]:
    """Expert parameters whose host rows the checkpoint did not fill completely (``experts``: E of each layer)."""
    out = []
    for layer, specs in layers.items():
        for param in specs:
            parts, done = seen.get((layer, param), [1, set()])
            want = experts[layer] * parts
            got = len(done)
            if got != want:
                out.append(f"{layer}.{param} ({got} of {want} expert pieces)")
    return out
