"""Every knob of paging, validated once, before anything is allocated: ``PagingConfig`` (frozen),
the rules (K, a split's K, admission, the device planner, prefetch values) one home each,
``Problems`` (everything wrong, said once per problem with the layers it affects), and ``ENV``,
the one table of ``MOEPAGE_*`` variables: unset or empty gives the default, a bad value is a
``ConfigError`` naming the variable and what is allowed.
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .residency import DEFAULT_POLICY, Policy, policy_names, resolve_policy

KV_RESERVE_FRACTION = 0.25  # auto K: the share of the GPU budget kept for the KV cache, by default
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


# -- the environment ---------------------------------------------------------------------------
def _flag(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError("not a flag (1/0, true/false, yes/no or on/off)")


def flag(value: object, what: str) -> bool:
    """An on/off option: a bool (or 0 / 1), or a string read as a ``MOEPAGE_*`` flag is (so ``verify="no"`` is off,
    not a truthy string), else a ``ConfigError`` naming ``what``."""
    if isinstance(value, str):
        try:
            return _flag(value.strip())
        except ValueError as exc:
            raise ConfigError(f"{what}={value!r} is {exc}") from None
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise ConfigError(f"{what} must be True or False (or 'on' / 'off'), got {value!r} ({type(value).__name__})")


def _whole(minimum: int) -> Callable[[str], int]:
    def read(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise ValueError(f"not a whole number >= {minimum}")
        return value

    return read


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise ValueError("not a number in [0, 1)")
    return value


def choice(*choices: str) -> Callable[[str], str]:
    """A ``Setting`` parser accepting one of ``choices``."""

    def read(text: str) -> str:
        if text not in choices:
            raise ValueError(f"not one of {', '.join(choices)}")
        return text

    return read


def checked(check: Callable[[str], object], what: str) -> Callable[[str], str]:
    """A ``Setting`` parser keeping the text that ``check`` accepts (``what`` it is not, otherwise)."""

    def read(text: str) -> str:
        try:
            check(text)
        except ValueError as exc:
            raise ValueError(f"not {what} ({exc})") from None
        return text

    return read


WRAP, SGLANG, VLLM = "wrap", "SGLang", "vLLM"  # where a variable applies: wrap (from_pretrained too), the plugins


@dataclass(frozen=True)
class Setting:
    """One ``MOEPAGE_*`` variable: parser (``ValueError`` naming what is allowed), default, help, and where it applies
    (every entry point reads every variable that is set, so a bad value is refused wherever it would apply)."""

    name: str
    parse: Callable[[str], Any] = field(repr=False)
    default: Any
    help: str
    applies: tuple[str, ...] = (WRAP, SGLANG, VLLM)

    def read(self) -> Any:
        text = os.environ.get(self.name, "").strip()
        if not text:
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            raise ConfigError(f"{self.name}={text!r} is {exc}; set an allowed value or unset it") from None


def _table(*settings: Setting) -> dict[str, Setting]:
    return {s.name: s for s in settings}


HOST_BUDGET_ALLOWED = ("host rows per layer (an integer H >= K; H >= E keeps every expert in host memory, no disk "
                       "tier) or a byte size shared by the layers, e.g. '64GiB'")


def host_budget(text: str) -> int | str:
    """Host rows per layer (an integer), or a byte size shared by the layers (``64GiB``); else a ``ValueError`` saying
    what is allowed. A budget at or below zero is refused as such: it holds no row, and each layer needs K."""
    from .units import parse_bytes

    text = text.strip()
    if re.fullmatch(r"-?[0-9]+", text):
        rows = int(text)
        if rows <= 0:
            raise ValueError(f"{'a negative number of' if rows else 'zero'} host rows; expected {HOST_BUDGET_ALLOWED}")
        return rows
    try:
        size = parse_bytes(text.removeprefix("-"))
    except ConfigError as exc:
        raise ValueError(f"not a number of host rows or a byte size ({exc}); expected {HOST_BUDGET_ALLOWED}") from None
    if text.startswith("-") or size <= 0:
        raise ValueError(f"{'a negative byte size' if size else 'zero bytes'}; expected {HOST_BUDGET_ALLOWED}")
    return text


def parse_cpu_share(value: object) -> float | str | None:
    """``cpu_share``: off (None, False, "off", 0 in any spelling: 0.0, "0.0"), "auto" (True, "on": the cost model splits
    each step's misses) or a share in (0, 1] (that share of each step's misses on the CPU, the ones with the fewest
    tokens, whatever the costs); else a ``ValueError`` saying what is allowed."""
    if value is None or value is False:
        return None
    if value is True:
        return "auto"
    text = str(value).strip().lower()
    if text in ("", "off", "false", "no"):
        return None
    if text in ("auto", "on", "true", "yes"):
        return "auto"
    try:
        share = float(text)
    except ValueError:
        share = -1.0
    if share == 0.0:  # no share of the misses: off, whether given as 0, 0.0 or "0.0"
        return None
    if not 0.0 < share <= 1.0:
        raise ValueError("not off, auto or a share in (0, 1] of each step's misses")
    return share


def _split_file(text: str) -> str:
    from .planning.budgets import load_split  # the split file's one reader

    try:
        load_split(text)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return text


ENV: dict[str, Setting] = _table(
    Setting("MOEPAGE_VERIFY", _flag, False, "after every page-in, compare the slots with their host rows"),
    Setting("MOEPAGE_LOG_EVERY", _whole(0), 0, "log one line per layer every N eager steps (logger 'moepage')"),
    Setting("MOEPAGE_POLICY", checked(resolve_policy, "a policy"), None,
            f"the eviction policy ({policy_names()})"),
    Setting("MOEPAGE_BACKEND", choice("cuda", "torch", "mock"), None,
            "the store of the paged layers (default: cuda where it runs, else torch)"),
    Setting("MOEPAGE_DEVICE_PLANNER", _flag, None, "the device planner: on (also on CPU) or off (default: on CUDA)"),
    Setting("MOEPAGE_SPLIT", _split_file, None,
            "a split file of per-layer K (moepage plan --trace T --budget N --out F)", (SGLANG, VLLM)),
    Setting("MOEPAGE_KV_RESERVE_FRACTION", _fraction, KV_RESERVE_FRACTION,
            "auto K: the share of the GPU budget kept for the KV cache", (SGLANG, VLLM)),
    Setting("MOEPAGE_STATS_PATH", str, None, "where a serving process writes its paged layers' counters", (SGLANG,)),
    Setting("MOEPAGE_SKIP_EMPTY_WAVES", _flag, False,
            "a CUDA graph's replay skips the waves its step leaves empty (graph if-nodes; torch 2.14, not 2.11)"),
    Setting("MOEPAGE_DECODE_OVERLAP", _flag, False,
            "a captured step of more than K experts pages wave i+1 in beside wave i's computation (waves of K // 2)"),
    Setting("MOEPAGE_HOST_BUDGET", host_budget, None,
            "keep this many expert rows per layer (or bytes, e.g. 64GiB) in host memory, the rest on disk"),
    Setting("MOEPAGE_SPILL_DIR", str, None, "with a host budget: where moepage keeps the expert rows it writes"),
    Setting("MOEPAGE_HOST_WARM", str, None,
            "with a host budget: a routing trace (moepage record); each layer's host tier starts with the experts it "
            "routes to most"),
    Setting("MOEPAGE_COMPRESS", _flag, False,
            "keep bf16 host rows losslessly coded (moepage.compress: ~1.33x less host memory), decoded at page-in"),
    Setting("MOEPAGE_CPU_SHARE", parse_cpu_share, None,
            "compute part of each eager step's missed experts on the CPU beside the page-ins: off, auto (a cost model "
            "measured at start-up decides) or a share in (0, 1]; not bit-exact (docs/cpu-split.md)"),
)


def env(name: str) -> Any:
    """The value of the ``MOEPAGE_*`` variable ``name`` (its default when unset)."""
    return ENV[name].read()


def environment_problems(problems: Problems) -> None:
    """Every ``MOEPAGE_*`` variable that is set, read once: an unreadable value is a problem wherever it applies."""
    for setting in ENV.values():
        try:
            setting.read()
        except ConfigError as exc:
            problems.add(str(exc))


# -- problems ------------------------------------------------------------------------------------
def listed(items: Sequence[object], shown: int = 3, sep: str = ", ") -> str:
    """``items`` joined by ``sep``, cut to the first ``shown`` where there are more, saying how many more: "a, b, c
    and 5 more" (what a message that lists layers, keys or experts says)."""
    words = [str(x) for x in items]
    if len(words) <= shown:
        return sep.join(words)
    return f"{sep.join(words[:shown])} and {len(words) - shown} more"


class Problems:
    """What is wrong with a model or a launch, collected before anything is allocated."""

    def __init__(self) -> None:
        self._items: dict[str, list[str]] = {}  # problem -> the layers it affects

    def add(self, text: str, layer: str | None = None) -> None:
        layers = self._items.setdefault(text, [])
        if layer is not None and layer not in layers:
            layers.append(layer)

    def __bool__(self) -> bool:
        return bool(self._items)

    def lines(self, total_layers: int | None = None) -> list[str]:
        out = []
        for text, layers in self._items.items():
            if not layers:
                out.append(text)
            elif len(layers) == 1:
                out.append(f"layer {layers[0]}: {text}")
            else:
                every = "all " if len(layers) == total_layers else ""
                out.append(f"{every}{len(layers)} layers ({listed(layers, 4)}): {text}")
        return out

    def raise_if_any(self, header: str, total_layers: int | None = None) -> None:
        if self._items:
            raise ConfigError(f"{header}:\n  - " + "\n  - ".join(self.lines(total_layers)))


# -- the rules -----------------------------------------------------------------------------------
def slot_count(value: object, what: str = "resident") -> int:
    """``value`` as a number of slots (an integer, not a bool), else a ``ConfigError``."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be an integer number of slots, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(
            f"{what} must be an integer number of slots (or a {{layer: K}} split, or a split file), "
            f"got {value!r} ({type(value).__name__})"
        ) from None


def split_k(split: Mapping[int | str, int], index: int, name: str) -> int | None:
    """A layer's K in a split (keys: module names, or the layers' indices among the paged ones)."""
    return split.get(name, split.get(index))


def admit_problem(admit: int, overlap: bool, smallest_k: int) -> str | None:
    """Prefill admission evicts into at most ``admit`` slots; overlapped waves take half of it."""
    least = 2 if overlap else 1
    if not least <= admit <= smallest_k:
        return f"prefill_admit={admit} is outside {least}..K={smallest_k} (the smallest K)"
    return None


def device_planner_problem(asked: bool | None, can_gather: bool, store_name: str, device: object) -> str | None:
    if asked and not can_gather:
        return (f"device_planner=True but the {store_name} store cannot gather a device-made plan into slots on "
                f"{device} (use backend='cuda' on CUDA, or 'torch' on CPU)")
    return None


def compress_problem(name: str, dtype: object) -> str | None:
    """Why tensor ``name`` of ``dtype`` cannot be kept coded (``moepage.compress``: bfloat16 only)."""
    from .compress import refusal

    why = refusal(dtype)  # type: ignore[arg-type]
    if why is None:
        return None
    return (f"compress=True codes bfloat16 expert rows only; {name!r} is {dtype}: {why}. "
            "Run without compress (or MOEPAGE_COMPRESS=0), or cast the experts to bfloat16 (from_pretrained: "
            "dtype=torch.bfloat16)")


def use_device_planner(asked: bool | None, can_gather: bool, device_type: str) -> bool:
    """Where the store can gather: by default on CUDA; ``True`` also elsewhere (torch on CPU)."""
    return can_gather and (asked if asked is not None else device_type == "cuda")


def parse_prefetch(value: object) -> bool | int:
    """Off (``False``, ``None``, "off"), on (``True``, "on": router top_k) or an int m >= 1 (top-m)."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "off", "on"):
            return text == "on"
        value = int(text) if text.isdigit() else 0
    try:
        m = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        m = 0
    if m < 1:
        raise ValueError(f"{value!r}: use off, on (the next layer's router, its top_k) or an int m >= 1 (router top-m)")
    return m


@dataclass(frozen=True)
class PagingConfig:
    """How every layer of a model pages (K and prefetch links are per layer, resolved with it).
    ``policy``: the eviction rule of both planners; ``verify``: check slots against host rows
    after every page-in and step; ``device_planner``: None = where the store can, on CUDA;
    ``overlap``: page wave i+1 in beside wave i; ``admit``: the slots a step of more than K
    experts may evict into (None: all); ``log_every``: a log line per N eager steps (0: never);
    ``compress``: keep the host rows coded (``moepage.compress``; bf16 only, ``compress_problem``);
    ``skip_empty_waves``: a captured step's replay skips the waves its routing leaves empty (graph if-nodes, where
    torch has them: ``capture.conditionals``); ``decode_overlap``: a device-planned step of more than K experts takes
    waves of K // 2, each paged in on the copy stream beside the previous wave's computation (no if-nodes then);
    ``cpu_share``: None (off), "auto" or a share in (0, 1]: eager steps are planned on the host and part of their
    missed experts computed on the CPU beside the page-ins (``moepage.split``; not bit-exact)."""

    policy: Policy = field(default_factory=lambda: resolve_policy(DEFAULT_POLICY))
    verify: bool = False
    device_planner: bool | None = None
    overlap: bool = False
    admit: int | None = None
    log_every: int = 0
    compress: bool = False
    skip_empty_waves: bool = False
    decode_overlap: bool = False
    cpu_share: float | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", resolve_policy(self.policy))  # a name is read as its policy

    @classmethod
    def from_options(
        cls,
        problems: Problems,
        *,
        policy: str | Policy | None = None,
        verify: bool | None = None,
        device_planner: bool | None = None,
        overlap: bool = False,
        admit: object = None,
        slot_counts: Sequence[int] = (),
        compress: bool | None = None,
        cpu_share: object = None,
        cpu_share_name: str = "cpu_share",
    ) -> PagingConfig:
        """These options, the environment filling what is None; what is wrong goes to ``problems``
        (a default takes its place). ``cpu_share_name``: how the caller's user names that option."""
        environment_problems(problems)
        chosen = DEFAULT_POLICY
        try:
            chosen = resolve_policy(policy if policy is not None else env("MOEPAGE_POLICY") or DEFAULT_POLICY)
        except (TypeError, ValueError) as exc:
            problems.add(f"policy: {exc}")

        def checked(value: object, name: str) -> bool | None:  # "no" is False, as in MOEPAGE_* variables
            if value is None:
                return None
            try:
                return flag(value, name)
            except ConfigError as exc:
                problems.add(str(exc))
                return None

        checked_verify, planner, overlapped = checked(verify, "verify"), checked(device_planner, "device_planner"), \
            checked(overlap, "prefill_overlap")
        checked_compress = checked(compress, "compress")
        admitted = None
        if admit is not None:
            try:
                admitted = slot_count(admit, "prefill_admit")
            except ConfigError as exc:
                problems.add(str(exc))
            why = admitted is not None and slot_counts and admit_problem(admitted, bool(overlapped), min(slot_counts))
            if why:
                problems.add(why)
        share = None
        if cpu_share is not None:
            try:
                share = parse_cpu_share(cpu_share)
            except ValueError as exc:
                problems.add(f"{cpu_share_name}={cpu_share!r} is {exc}")
        else:
            share = env_or_none("MOEPAGE_CPU_SHARE")
        return cls(
            policy=resolve_policy(chosen),
            verify=bool(env_or_none("MOEPAGE_VERIFY")) if verify is None else bool(checked_verify),
            device_planner=planner if device_planner is not None else env_or_none("MOEPAGE_DEVICE_PLANNER"),
            overlap=bool(overlapped), admit=admitted, log_every=env_or_none("MOEPAGE_LOG_EVERY") or 0,
            compress=bool(env_or_none("MOEPAGE_COMPRESS")) if compress is None else bool(checked_compress),
            skip_empty_waves=bool(env_or_none("MOEPAGE_SKIP_EMPTY_WAVES")),
            decode_overlap=bool(env_or_none("MOEPAGE_DECODE_OVERLAP")),
            cpu_share=share,
        )


def env_or_none(name: str) -> Any:
    """A variable's value, or None where it is unreadable (``environment_problems`` has said so already)."""
    try:
        return env(name)
    except ConfigError:
        return None

