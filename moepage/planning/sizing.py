"""Checkpoint sizing for choosing K: safetensors headers only, no weight is read.

Owns ``checkpoint_size``, the sizing rule ``CheckpointSize.slots_fitting`` (with ``max_resident``: the K that
``moepage plan`` recommends and SGLang's ``--paged-experts-num-resident auto`` starts from), the host bytes of a
paged load (``host_bytes``) and ``read_index``. A tensor's bytes are its header's ``end - begin`` (exact for packed
dtypes too); a file is exactly ``8 + N + max(end)`` bytes, so its size tells a truncated one. Routed experts (all else
is dense): per-expert ``<prefix>.experts.<e>.<rest>`` (quantization companions included) count toward e; stacked
``<prefix>.experts.<name>`` with leading dimension E count ``bytes / E`` each; ``shared_expert(s)`` are dense. E and
top_k come from ``config.json`` (or its ``text_config`` / ``language_config``), else E is inferred and top_k unknown.
A slot is sized for its layer's largest expert.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..residency import k_problem

_PER_EXPERT = re.compile(r"^(?P<layer>(?:.+\.)?experts)\.(?P<e>\d+)\.(?P<rest>.+)$")
_STACKED = re.compile(r"^(?P<layer>(?:.+\.)?experts)\.(?P<rest>[^.\d][^.]*(?:\.[^.]+)*)$")
_E_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "top_k")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    offset: int = 0  # where its data begins in the file


@dataclass
class CheckpointSize:
    """What one slot and the always-resident part of a checkpoint cost on the device."""

    num_experts: int  # E (the smallest over layers if they differ: K <= E for every layer)
    top_k: int | None  # from config.json; None if unknown
    moe_layers: list[str]  # ``<prefix>.experts`` of every MoE layer
    expert_bytes: list[int]  # per MoE layer: bytes of one expert (its largest)
    experts_total_bytes: int  # all routed experts of all layers
    dense_bytes: int  # everything else: always on the device
    files: list[str] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def slot_bytes(self) -> int:
        """One slot in every MoE layer: what K + 1 costs over K."""
        return sum(self.expert_bytes)

    @property
    def total_bytes(self) -> int:
        return self.experts_total_bytes + self.dense_bytes

    @property
    def min_resident(self) -> int:
        return self.top_k or 1

    def device_bytes(self, k: int) -> int:
        """Weights on the device at K slots per layer: dense + K slots."""
        return self.dense_bytes + k * self.slot_bytes

    def slots_fitting(self, budget_bytes: int, reserve_bytes: int = 0) -> int:
        """Slots per layer that ``budget_bytes`` buys once the dense weights and ``reserve_bytes`` are set aside
        (not capped at E; 0 when even those do not fit): the one sizing rule of ``plan`` and SGLang's ``auto``."""
        free = budget_bytes - reserve_bytes - self.dense_bytes
        if free < 0:
            return 0
        return int(free // self.slot_bytes) if self.slot_bytes else self.num_experts

    def max_resident(self, budget_bytes: int, reserve_bytes: int = 0) -> int:
        """Largest K <= E whose weights plus ``reserve_bytes`` fit ``budget_bytes`` (``moepage plan`` recommends
        it); 0 below ``min_resident``."""
        k = min(self.num_experts, self.slots_fitting(budget_bytes, reserve_bytes))
        return k if k >= self.min_resident else 0

    @property
    def host_bytes(self) -> int:
        """Host memory a paged load keeps: all E experts of every MoE layer, in pinned host rows (the dense weights
        and the K slots go to the GPU; tensors in flight while loading are one at a time)."""
        return self.experts_total_bytes


def read_header(path: str | os.PathLike) -> list[TensorInfo]:
    """One safetensors file's tensors from its header; a ``ConfigError`` naming it if not one, or truncated."""
    size = os.path.getsize(path)
    if size < 8:
        raise ConfigError(f"{path}: {size} bytes, too short for a safetensors file "
                          "(8-byte header length + JSON header)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(100 * 2**20, size - 8):  # the format caps headers at 100 MB
            raise ConfigError(f"{path}: header length {n} does not fit a {size}-byte file: "
                              "not a safetensors file, or truncated")
        out, data_end = [], 0
        try:
            for name, info in json.loads(f.read(n)).items():
                if name == "__metadata__":
                    continue
                begin, end = (int(x) for x in info["data_offsets"])
                out.append(TensorInfo(name, tuple(info["shape"]), info["dtype"], end - begin, 8 + n + begin))
                data_end = max(data_end, end)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise ConfigError(f"{path}: not a safetensors header ({type(exc).__name__}: {exc})") from None
    if size != 8 + n + data_end:
        raise ConfigError(
            f"{path}: truncated or corrupt: its header describes {8 + n + data_end} bytes, the file has {size}; "
            "download or save it again"
        )
    return out


def _config_value(config: dict, keys: tuple[str, ...]) -> int | None:
    for scope in (config, config.get("text_config") or {}, config.get("language_config") or {}):
        for key in keys:
            if isinstance(scope.get(key), int) and scope[key] > 0:
                return scope[key]
    return None


def safetensors_files(path: Path) -> list[Path]:
    """A checkpoint's safetensors files (those its index names, else every one in the folder), or a ``ConfigError``."""
    if not path.exists():
        raise ConfigError(f"{path}: no such file or directory; pass a checkpoint directory or a .safetensors file")
    if path.is_file():
        if path.suffix in (".npz", ".npy", ".jsonl", ".json"):  # a trace's suffixes (``traces.LAYOUTS``)
            raise ConfigError(f"{path}: a routing trace, not a checkpoint; pass the checkpoint, and the trace with "
                              "--trace")
        return [path]
    index = path / "model.safetensors.index.json"
    if index.exists():  # only the files it names (a directory may hold stray ones)
        names = sorted(set(read_index(index).values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ConfigError(f"{index}: names {len(missing)} missing file(s), e.g. {missing[0]}; download them")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: no *.safetensors files in this directory; pass a safetensors checkpoint")
    return files


def _read_json(path: Path):
    """The JSON in ``path``, or a ``ConfigError`` naming the file."""
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not JSON ({type(exc).__name__}: {exc}); fix or remove it") from None


def read_index(path: str | os.PathLike) -> dict[str, str]:
    """The ``weight_map`` (``{tensor name: file}``) of a ``model.safetensors.index.json``, or a ``ConfigError``
    naming the file and the layout expected (the sizing and the transformers loader both read it here)."""
    data = _read_json(Path(path))
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ConfigError(f'{path}: not a safetensors index: expected {{"weight_map": {{"<tensor name>": '
                          f'"<file>.safetensors", ...}}}}, got {json.dumps(data)[:80]}; fix it or download it again')
    return weight_map


def checkpoint_size(path: str | os.PathLike) -> CheckpointSize:
    """Size a checkpoint (a directory of safetensors files, or one file) from its headers."""
    path = Path(path)
    files = safetensors_files(path)
    config_path = (path if path.is_dir() else path.parent) / "config.json"
    config = _read_json(config_path) if config_path.exists() else {}
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path}: not a config (a JSON object), got {type(config).__name__}; fix or remove it")
    tensors = [t for f in files for t in read_header(f)]
    per_expert: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    stacked: dict[str, list[TensorInfo]] = defaultdict(list)
    for t in tensors:
        if m := _PER_EXPERT.match(t.name):
            per_expert[m["layer"]][int(m["e"])] += t.nbytes
        elif (m := _STACKED.match(t.name)) and t.shape:
            stacked[m["layer"]].append(t)
    layers = sorted(set(per_expert) | set(stacked), key=_natural)
    if not layers:
        raise ConfigError(f"{path}: no routed expert tensors found "
                          "(looked for '.experts.<e>.' and stacked '.experts.<name>')")
    config_e = _config_value(config, _E_KEYS)
    expert_bytes, counts, experts_total = [], [], 0
    for layer in layers:
        e = config_e or (max(per_expert[layer]) + 1 if per_expert[layer]
                         else Counter(t.shape[0] for t in stacked[layer]).most_common(1)[0][0])
        rows = [per_expert[layer].get(i, 0) for i in range(e)]
        for t in stacked[layer]:
            if t.shape[0] == e and t.nbytes % e == 0:  # other tensors there (a global scale) are dense
                rows = [r + t.nbytes // e for r in rows]
                experts_total += t.nbytes
        experts_total += sum(per_expert[layer].values())
        expert_bytes.append(max(rows))
        counts.append(e)
    total = sum(t.nbytes for t in tensors)
    return CheckpointSize(min(counts), _config_value(config, _TOPK_KEYS), layers, expert_bytes, experts_total,
                          total - experts_total, [f.name for f in files])


def _natural(s: str) -> list:
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", s)]


def _of_e(fraction: float, num_experts: int) -> int:
    """The K that a fraction of E names, rounded half up."""
    return int(fraction * num_experts + 0.5)


def default_ks(num_experts: int, top_k: int, *more: int) -> list[int]:
    """The K a table shows when none is given: E/4, E/2, 3E/4 and ``more``, each raised to at least ``top_k`` (a K
    below it cannot run) and at most E."""
    return sorted({min(num_experts, max(top_k, k)) for k in (*(_of_e(f, num_experts) for f in (0.25, 0.5, 0.75)),
                                                                *more)})


def resolve_k(value: str | float | int, num_experts: int, top_k: int | None = None) -> int:
    """K from ``"0.25"`` (a fraction of E: has a '.', rounded half up) or ``"8"`` (absolute), in top_k..E (the K rule,
    ``residency.k_problem``; 1..E where ``top_k`` is None): a K outside is a ``ConfigError``, never skipped."""
    text = str(value).strip()
    try:
        k = _of_e(float(text), num_experts) if "." in text else int(text)
    except ValueError:
        raise ConfigError(f"K {value!r} is neither a slot count (8) nor a fraction of E (0.25)") from None
    if why := k_problem(k, num_experts, top_k, "K"):
        raise ConfigError(why + (f"; {text} of E={num_experts} is K={k}" if "." in text else ""))
    return k
