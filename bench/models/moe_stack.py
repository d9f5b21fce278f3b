"""The benchmark model of ``model_decode.py`` and its decode loop: a stack of residual + RMSNorm +
router hook + HF ``Qwen3MoeExperts`` (``grouped_mm``) layers with seeded random bf16 weights, the
same layers over SGLang's paged-experts mechanism, moepage's store with host rows kept across
wraps, and ``run``: the decode steps of one configuration, one CUDA graph replayed per step."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import capture, hf_experts
from bench.kernels.sglang_kernels import SglangPager

PARAMS = ("gate_up_proj", "down_proj")
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


@dataclass(frozen=True)
class Spec:
    name: str
    layers: int
    experts: int
    top_k: int
    hidden: int
    inter: int
    q_dim: int  # attention projections, for --attn-proxy
    kv_dim: int

    @property
    def expert_bytes(self) -> int:  # gate_up [2I, H] + down [H, I], bf16
        return 3 * self.hidden * self.inter * 2


SPECS = {"qwen3": Spec("Qwen3-30B-A3B", 48, 128, 8, 2048, 768, 32 * 128, 4 * 128),
         "granite": Spec("Granite-3.0-1B-A400M", 24, 32, 8, 1024, 512, 16 * 64, 8 * 64)}
SMOKE = Spec("smoke", 2, 16, 4, 64, 32, 64, 32)


class Block(nn.Module):
    """Residual + RMSNorm + the router hook + the experts module (+ an attention proxy)."""

    def __init__(self, experts: nn.Module, norm: torch.Tensor, router: torch.Tensor, attn=None):
        super().__init__()
        self.experts, self.norm, self.router, self.attn = experts, norm, router, attn  # tensors shared by all models

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.attn is not None:  # q, k, v projections read, q through the output projection
            qkv = F.linear(F.rms_norm(x, x.shape[-1:], self.norm[1], 1e-6), self.attn[0])
            x = x + F.linear(qkv[:, : self.attn[1].shape[1]], self.attn[1])
        h = F.rms_norm(x, x.shape[-1:], self.norm[0], 1e-6)
        w = F.linear(h, self.router).float().softmax(-1).gather(1, ids)  # the hook: trace ids, data weights
        return x + self.experts(h, ids, (w / w.sum(-1, keepdim=True)).to(x.dtype))


class MoEStack(nn.Module):
    """The layers; ``ids`` ``[layers, B, top_k]`` is the router hook's static device buffer."""

    def __init__(self, blocks: list[Block]):
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.layers):
            x = block(x, self.ids[i])
        return x


def expert_weight(spec: Spec, layer: int, name: str, device: torch.device) -> torch.Tensor:
    """Layer ``layer``'s stacked ``name``: N(0, 0.02) bf16, drawn on ``device``; the same bytes
    whenever it is made there."""
    shape = ((spec.experts, 2 * spec.inter, spec.hidden) if name == PARAMS[0]
             else (spec.experts, spec.hidden, spec.inter))
    g = torch.Generator(device=device).manual_seed(1000 * layer + PARAMS.index(name))
    return torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16).mul_(0.02)


def dense_weights(spec: Spec, attn: bool, device: torch.device) -> list[dict]:
    """Per layer: two RMSNorm weights, the router [E, H], with ``attn`` the attention projections."""
    g = torch.Generator(device=device).manual_seed(7)
    rnd = lambda *s: torch.randn(s, generator=g, device=device, dtype=torch.bfloat16)  # noqa: E731
    h, q = spec.hidden, spec.q_dim
    return [dict(norm=rnd(2, h).mul_(0.1).add_(1), router=rnd(spec.experts, h).mul_(0.02),
                 attn=(rnd(q + 2 * spec.kv_dim, h).mul_(0.02), rnd(h, q).mul_(0.02)) if attn else None)
            for _ in range(spec.layers)]


def experts(spec: Spec, layer: int | None = None, device: torch.device | None = None) -> nn.Module:
    """An HF experts module on meta (for moepage's loader), or with ``layer``'s weights on ``device``."""
    ex = hf_experts(spec.hidden, spec.inter, spec.experts, spec.top_k)
    for n in PARAMS if layer is not None else ():
        setattr(ex, n, nn.Parameter(expert_weight(spec, layer, n, device), requires_grad=False))
    return ex


def build(dense: list[dict], experts_of) -> MoEStack:
    return MoEStack([Block(experts_of(i), **d) for i, d in enumerate(dense)])


class SglangExperts(nn.Module):
    """SGLang's device-planned step on one layer: ``SglangPager.step``, then ``inner``'s forward on
    the slot ids (``inner``: an HF experts module over the K slots)."""

    def __init__(self, inner: nn.Module, pager: SglangPager):
        super().__init__()
        self.inner, self.pager = inner, pager

    def forward(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.inner(h, self.pager.step(ids), w)


class KeptMemory:
    """Host memory whose rows outlive ``free``: each K/E wraps the model again over the same rows
    without pinning and filling 58 GB again; ``close`` frees them. ``issued``/``filled`` let the
    loader fill each buffer once, and every buffer this memory did not hand out, always."""

    def __init__(self, inner):
        self.inner, self.kind = inner, inner.kind
        self.kept, self.issued, self.filled = {}, set(), set()

    def check_device(self, layer, device):
        self.inner.check_device(layer, device)

    def alloc(self, layer, spec, num_experts):
        if (layer, spec, num_experts) not in self.kept:
            rows = self.inner.alloc(layer, spec, num_experts)
            self.kept[layer, spec, num_experts] = rows
            self.issued.add(rows.data_ptr())
            self.filled.discard(rows.data_ptr())
        return self.kept[layer, spec, num_experts]

    def free(self, layer):
        pass  # kept for the next wrap

    def close(self):
        self.inner.close()


def kept_rows_store(device: torch.device):
    """moepage's store (``cuda``; ``torch`` on CPU) over ``KeptMemory``."""
    from moepage.backends.store import PageableMemory, Store, TorchGather

    if device.type != "cuda":
        return Store("torch", KeptMemory(PageableMemory()), TorchGather())
    from moepage.backends.cuda import MappedMemory, TritonGather

    return Store("cuda", KeptMemory(MappedMemory()), TritonGather())


class RowLoader:
    """``wrap(load=)``: fills the host rows (drawn on ``device``, copied down), each buffer once;
    times itself."""

    def __init__(self, spec: Spec, device: torch.device):
        self.spec, self.device, self.started, self.seconds, self.filled_gb = spec, device, None, 0.0, 0.0

    def __call__(self, store, layers: dict) -> None:
        self.started, t0 = time.perf_counter(), time.perf_counter()
        for name, specs in layers.items():
            for n in specs:
                host = store.host_rows(name, n)
                if host.data_ptr() in store.memory.filled:
                    continue
                host.copy_(expert_weight(self.spec, int(name.split(".")[1]), n, self.device), non_blocking=True)
                self.filled_gb += host.nbytes / 1e9
                if host.data_ptr() in store.memory.issued:
                    store.memory.filled.add(host.data_ptr())
        torch.cuda.synchronize() if self.device.type == "cuda" else None
        self.seconds = time.perf_counter() - t0


def slot_experts(spec: Spec, store, name: str, k: int) -> nn.Module:
    """An HF experts module computing over the K slots of layer ``name`` (slot ids as expert ids)."""
    ex = experts(spec)
    for p in PARAMS:
        setattr(ex, p, nn.Parameter(store.slots(name, p), requires_grad=False))
    ex.num_experts = k
    return ex


class Clock:
    """Marks between steps: CUDA events on the GPU, host time on CPU (smoke)."""

    def __init__(self, device: torch.device):
        self.cuda, self.marks = device.type == "cuda", []

    def mark(self) -> None:
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def ms(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def run(model: MoEStack, ids_host: torch.Tensor, xs: torch.Tensor, warmup: int, steps: int, misses=None,
        graph: bool = True):
    """Decode steps 0..warmup+steps-1 (the graph replayed, or eager if it cannot be captured);
    returns the timing of the last ``steps`` and every step's output ``[n, B, H]``. ``misses``:
    a counter read before and after the timed steps."""
    dev = xs.device
    ids_buf = torch.empty(ids_host.shape[1:], dtype=torch.int64, device=dev)
    x_buf = torch.empty_like(xs[0])
    model.ids = ids_buf
    ids_buf.copy_(ids_host[0])
    x_buf.copy_(xs[0])
    mode, step = "graph" if dev.type == "cuda" else "eager (CPU smoke)", lambda: model(x_buf)
    if dev.type == "cuda" and not graph:
        mode = "eager"
    elif dev.type == "cuda":
        try:
            graph, out = capture(step, warmup=1)
            step = lambda: (graph.replay(), out)[1]  # noqa: E731
        except Exception as exc:  # noqa: BLE001 - recorded in the row; the run goes on eagerly
            torch.cuda.synchronize()
            warmup, steps = min(warmup, 4), min(steps, 8)
            mode = f"eager ({steps} steps): capture raised {type(exc).__name__}: {str(exc).splitlines()[0][:140]}"
            log(f"  not capturable, timing {steps} eager steps: {mode}")
    hist = torch.empty((warmup + steps, *xs.shape[1:]), dtype=xs.dtype, device=dev)
    clock, before = Clock(dev), None
    for t in range(warmup + steps):
        if t == warmup:
            before = misses() if misses else None
            clock.mark()
        ids_buf.copy_(ids_host[t], non_blocking=True)
        x_buf.copy_(xs[t])
        hist[t].copy_(step())
        if t >= warmup:
            clock.mark()
    ms = clock.ms()
    res = dict(mode=mode, ms=sum(ms) / len(ms), ms_median=statistics.median(ms), warmup=warmup, steps=steps)
    if misses and before is not None:
        res["misses_step"] = (misses() - before) / steps
    return res, hist


def first_difference(hist: torch.Tensor, ref: torch.Tensor) -> int | None:
    return next((t for t in range(hist.shape[0]) if not torch.equal(hist[t], ref[t])), None)
