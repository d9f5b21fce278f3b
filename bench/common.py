"""What the benchmark scripts share: the benchmark layer, the link's reference bandwidth, CUDA-event
timing and graph capture (with or without skipping empty waves), the physics bound, goal verdicts,
markdown tables, JSON and plots."""

from __future__ import annotations

import json
import operator
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch


def hf_experts(hidden: int = 2048, inter: int = 768, num_experts: int = 128, top_k: int = 8,
               device: str | torch.device = "meta", dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """HF ``Qwen3MoeExperts`` (``grouped_mm``) of these shapes (default Qwen3-30B-A3B's), made
    uninitialised on ``device`` in ``dtype``; on "meta" it holds no memory."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=num_experts,
                                      num_experts_per_tok=top_k)
    cfg._experts_implementation = "grouped_mm"
    with torch.device(device):
        return Qwen3MoeExperts(cfg).to(dtype)


def qwen3_experts(device: str = "cuda") -> torch.nn.Module:
    """``hf_experts`` with Qwen3-30B-A3B expert shapes (E=128, top-8, H=2048, I=768) on ``device``,
    bf16, weights drawn N(0, 0.02)."""
    layer = hf_experts(device=device)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return layer.requires_grad_(False)  # inference only: moepage refuses grad mode on parameters requiring grad


def memcpy_gbs(nbytes: int = 1 << 30, device: str = "cuda", host: torch.Tensor | None = None) -> float:
    """GB/s of one large pinned host -> device cudaMemcpyAsync (the link's reference peak): of
    ``nbytes`` fresh pinned bytes, or of the whole pinned tensor ``host`` when given."""
    if host is None:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host = host.reshape(-1)
    nbytes = host.numel() * host.element_size()
    dev = torch.empty_like(host, device=device)
    for _ in range(2):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    b.record()
    b.synchronize()
    return 5 * nbytes / (a.elapsed_time(b) * 1e6)


def disk_read_gbs(folder: str | Path, nbytes: int = 1 << 30, threads: int = 4, chunk: int = 8 << 20) -> float:
    """GB/s of direct reads (``O_DIRECT`` where the file system takes it: the disk, not the page cache) of a fresh
    ``nbytes`` file in ``folder``, ``chunk`` bytes a read from ``threads`` threads, as the disk tier reads rows."""
    import mmap
    import os
    import time
    from concurrent.futures import ThreadPoolExecutor

    from moepage.backends.disk import OsFile

    path = Path(folder) / f".disk_read_gbs.{os.getpid()}"
    path.parent.mkdir(parents=True, exist_ok=True)
    block = os.urandom(chunk)
    with open(path, "wb") as f:
        for _ in range(nbytes // chunk):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    try:
        files, offsets = [OsFile(str(path)) for _ in range(threads)], range(0, nbytes // chunk * chunk, chunk)

        def read(i: int) -> int:
            buf = mmap.mmap(-1, chunk)  # page-aligned, as direct reads need
            return sum(files[i].readinto(memoryview(buf), off) for off in offsets[i::threads])

        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            done = sum(pool.map(read, range(threads)))
        return done / (time.perf_counter() - start) / 1e9
    finally:
        for f in files:
            f.close()
        path.unlink(missing_ok=True)


def versions() -> str:
    """The device and the versions a result depends on, for the first line of a report."""
    import importlib.metadata as md

    def v(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "absent"

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    return f"{device}, torch {torch.__version__}, triton {v('triton')}, transformers {v('transformers')}"


def time_ms(fn: Callable[[], Any], reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def capture(fn: Callable[[], Any], n: int = 1, warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn`` called ``warmup`` times eagerly on a side stream, then ``n`` times captured in one
    CUDA graph, both inside ``moepage.capture_mode()`` (paged steps take the path the capture
    takes); returns the graph and the captured last call's result (its static output)."""
    import moepage

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), moepage.capture_mode():
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    out = None
    with moepage.capture_mode(), torch.cuda.graph(g):
        for _ in range(n):
            out = fn()
    return g, out


def graph_of(fn: Callable[[], Any], n: int) -> torch.cuda.CUDAGraph:
    return capture(fn, n)[0]


@contextmanager
def paging_config(model: torch.nn.Module, **fields: Any) -> Iterator[None]:
    """Inside, the paged layers of ``model`` page with these ``PagingConfig`` fields (e.g. ``skip_empty_waves=True``:
    captures skip empty waves as graph if-nodes; ``decode_overlap=True``: captured steps of more than K in overlapped
    waves of K // 2), for a run side by side with the default's."""
    import moepage

    pagers = [layer.pager for layer in moepage.paged_layers(model)]
    before = [p.config for p in pagers]
    for p in pagers:
        p.config = replace(p.config, **fields)
    try:
        yield
    finally:
        for p, config in zip(pagers, before):
            p.config = config


def guarded(errors: list[str], what: str, fn: Callable[..., Any], *args) -> Any:
    """``fn(*args)``, or None with the error appended to ``errors`` (the other configurations still run)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        errors.append(f"{what}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}")
        return None


# -- the physics bound and the goals -------------------------------------------------------------------
def bound_ms(unpaged_ms: float, nbytes: float, link_gbs: float) -> float:
    """The physics bound of a paged step: the unpaged step plus the bytes it pages (``nbytes``) at
    the link's rate (``link_gbs``, GB/s)."""
    return unpaged_ms + nbytes / (link_gbs * 1e9) * 1e3


OPS = {"<=": operator.le, ">=": operator.ge, ">": operator.gt}


@dataclass(frozen=True)
class Goal:
    """A goal on one measured figure: met where ``value op limit`` (op "<=", ">=" or ">"). ``text``
    states it in a report line, with the fields ``{value}`` (the figure formatted ``fmt``; "-" where
    there is none, which is not met), ``{verdict}`` ("met" or "NOT met"), ``{op}`` and ``{limit}``."""

    op: str
    limit: float
    text: str = ""
    fmt: str = ".3f"

    def met(self, value: float | None) -> bool:
        return value is not None and OPS[self.op](value, self.limit)

    def verdict(self, value: float | None) -> str:
        return "met" if self.met(value) else "NOT met"

    def line(self, where: str, value: float | None) -> str:
        """``- where: text``, the goal stated as met or not, with its number."""
        return f"- {where}: " + self.text.format(value=num(value, self.fmt), verdict=self.verdict(value), op=self.op,
                                                 limit=self.limit)


# -- tables, JSON, plots ----------------------------------------------------------------------------
def num(v: Any, spec: str = ".3f", missing: str = "-") -> str:
    """One figure of a table or a log line: ``v`` formatted ``spec``, or ``missing`` where it is None."""
    return missing if v is None else format(v, spec)


def plain(v: Any) -> str:
    """A table cell by default: floats with three decimals, anything else as ``str``."""
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def table(rows: list[dict], cell: Callable[[Any], str] = plain, missing: str = "", empty: str = "(no rows)") -> str:
    """Markdown table of ``rows``; columns: every key, in order of first appearance. A value is
    written ``cell(value)``, a key a row lacks ``missing``; no rows: ``empty``."""
    if not rows:
        return empty
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(cell(r[k]) if k in r else missing for k in keys) + " |" for r in rows])


def write_json(path: str | Path | None, data: Any) -> None:
    """``data`` as JSON at ``path`` (indent 1, other types as ``str``); nothing where ``path`` is None."""
    if path:
        Path(path).write_text(json.dumps(data, indent=1, default=str))


def figure(panels: int = 1, size: tuple[float, float] = (6, 3.5), cols: int | None = None):
    """A figure of ``panels`` axes, ``size`` inches each, in one row (or rows of ``cols``), matplotlib
    imported here (Agg backend; ImportError where it is missing): ``(fig, axes)``, the axes a flat
    list, the unused ones of the last row hidden."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(cols or panels, panels) or 1
    rows = -(-panels // cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), squeeze=False)
    for ax in axes.flat[panels:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def bars(ax, series: Sequence[tuple[str | None, Sequence[float]]], width: float = 0.8) -> list[list[float]]:
    """Grouped bars on ``ax``: group i at x = i, one bar per ``(label, heights)`` of ``series``, side by
    side within ``width``; returns each series' bar positions."""
    w = width / max(len(series), 1)
    xs = [[i + (j - (len(series) - 1) / 2) * w for i in range(len(heights))] for j, (_, heights) in enumerate(series)]
    for x, (label, heights) in zip(xs, series):
        ax.bar(x, heights, w, label=label)
    return xs


def save(fig, path: str | Path, title: str | None = None) -> None:
    """``fig`` (with ``title`` above its panels) laid out and written to ``path`` at 120 dpi, then closed."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
