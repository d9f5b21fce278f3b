"""Host memory left for a paged load, whose E experts of every MoE layer all live in host rows.

``host_memory_available`` is the smaller of the kernel's ``MemAvailable`` (``/proc/meminfo``) and the room under every
cgroup memory limit above this process (v2 ``memory.max``, v1 ``memory.limit_in_bytes``, less the usage); ``None``
where neither is readable (not Linux). ``root`` relocates ``/proc`` and ``/sys`` (tests). ``moepage plan`` prints it
and ``from_pretrained`` refuses a load that ``AvailableMemory.fits`` says does not fit, before reading any weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_UNLIMITED = 2**62  # cgroup v1 writes "no limit" as a huge page-aligned number


@dataclass(frozen=True)
class AvailableMemory:
    """Bytes of host memory this process can still take, and where the figure came from."""

    available: int
    source: str

    def fits(self, needed: int) -> bool:
        return needed <= self.available


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _number(path: Path) -> int | None:
    text = (_read(path) or "").strip()
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _shown(path: Path, root: Path) -> str:
    return "/" + str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _meminfo(root: Path) -> AvailableMemory | None:
    path = root / "proc" / "meminfo"
    for line in (_read(path) or "").splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return AvailableMemory(int(fields[1]) * 1024, f"MemAvailable in {_shown(path, root)}")
    return None


def _cgroups(root: Path) -> list[AvailableMemory]:
    """The room under each memory limit from this process's cgroup up to the hierarchy's root (v2 and v1)."""
    # (controller field of /proc/self/cgroup, mount, limit, usage, stat key of reclaimable page cache)
    layouts = (("", "sys/fs/cgroup", "memory.max", "memory.current", "inactive_file", "v2"),
               ("memory", "sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                "total_inactive_file", "v1"))
    out = []
    lines = (_read(root / "proc" / "self" / "cgroup") or "0::/\n").splitlines()
    for controller, mount, limit_name, usage_name, cache_key, version in layouts:
        paths = [line.split(":", 2)[2] for line in lines
                 if line.count(":") >= 2 and controller in line.split(":", 2)[1].split(",")]
        base = root / mount
        for own in paths or ["/"]:
            here = base / own.lstrip("/")
            while True:
                limit = _number(here / limit_name)  # v2 "max" (no limit) reads as None
                usage = _number(here / usage_name)
                if limit is not None and usage is not None and limit < _UNLIMITED:
                    # Page cache it may reclaim is not in use: count the working set, as the OOM killer would.
                    used = max(0, usage - _stat(here / "memory.stat", cache_key))
                    source = f"cgroup {version} limit {_shown(here / limit_name, root)} less its usage"
                    out.append(AvailableMemory(max(0, limit - used), f"{source} ({usage_name} - {cache_key})"))
                if here == base or not here.is_relative_to(base):
                    break
                here = here.parent
    return out


def host_memory_available(root: str | Path = "/") -> AvailableMemory | None:
    """The host memory this process can still take (the tightest of ``MemAvailable`` and its cgroup limits)."""
    root = Path(root)
    found = [m for m in (_meminfo(root), *_cgroups(root)) if m is not None]
    return min(found, key=lambda m: m.available) if found else None
