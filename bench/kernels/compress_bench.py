"""Compressed host store (``moepage.compress``) on a CUDA GPU: what coding the host rows costs or
gains at page-in, side by side with raw rows in one run. Qwen3-30B-A3B expert shapes
(``gate_up_proj`` [1536, 2048] + ``down_proj`` [2048, 768], bf16, weights N(0, 0.02), E = 128).

a. device gather of a plan of m experts: the raw gather (``kernels.gather``) vs the decode
   (``kernels.unpack``); effective GB/s = bf16 bytes delivered into the slots per second, each
   over one cudaMemcpyAsync of >= 256 MB raw bytes timed in the same run (the link's peak);
   outputs checked bit for bit first.
b. host-planned page-in of the same m experts: raw rows by the copy engine (one copy per row) vs
   one decode launch (the cuda store's ``page_in``).
c. a 100 %-hit captured decode layer (K = 64, tokens 1 / 4 / 8): unpaged vs paged raw vs paged
   compressed, outputs ``torch.equal`` to unpaged.
d. host bytes of the layer, raw vs coded.
e. captured decode of a stack of ``--stack-layers`` such layers (residual between them) at K/E 0.25 and 0.5, batch 1
   and 8, uniform routing drawn fresh for every step (misses in every step; batch 8 x top-8 = 64 entries: several
   device waves at K = 32): ms/step unpaged, raw and compressed, the raw run's bound (unpaged + its missed bf16
   bytes at the memcpy peak), and compressed over raw. Every timed replay's output ``torch.equal`` to unpaged.

    python -m bench.kernels.compress_bench [--json out.json] [--experts 64,32,8] [--stack-layers 4] [--only e]

Without CUDA it prints SKIPPED; ``--tiny`` runs table a on small rows on the CPU under the Triton
interpreter (a smoke test: its timings mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections.abc import Callable

import torch

from bench import common
from moepage import compress as C
from moepage.kernels.gather import PointerTable, gather_rows
from moepage.kernels.unpack import CodedTable, gather_coded

Q3 = {"gate_up_proj": (1536, 2048), "down_proj": (2048, 768)}
TINY = {"gate_up_proj": (64, 64), "down_proj": (64, 32)}
E, K, TOP_K = 128, 64, 8


def layer_rows(shapes: dict[str, tuple[int, ...]], experts: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One layer's expert rows as transformers initialises Qwen3-MoE experts (fp32 N(0, 0.02), cast to bf16)."""
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.empty((experts, *s)).normal_(0.0, 0.02, generator=gen).to(torch.bfloat16)
            for n, s in shapes.items()}


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Median ms of ``fn``: CUDA events on a GPU, wall time (interpreter) on the CPU."""
    if device.type == "cuda":
        return common.time_ms(fn)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


class Tables:
    """The layer's rows twice on the host, raw and coded (pinned on CUDA), each with its slots and kernel table."""

    def __init__(self, *, rows: dict[str, torch.Tensor], slots: int, device: torch.device):
        pin = device.type == "cuda"
        self.rows, self.device = rows, device
        self.codes = {n: C.plan_code(r, chunk=slots).code for n, r in rows.items()}
        if any(c is None for c in self.codes.values()):
            raise SystemExit(f"a tensor stays raw: {self.codes}")
        keep = (lambda t: t.pin_memory()) if pin else (lambda t: t)
        self.raw_hosts = [keep(r) for r in rows.values()]
        self.coded_hosts = [keep(torch.cat([C.encode_rows(r[i : i + slots], self.codes[n])
                                            for i in range(0, r.shape[0], slots)])) for n, r in rows.items()]
        new_slots = lambda: [torch.empty((slots, *r.shape[1:]), dtype=r.dtype, device=device) for r in rows.values()]
        self.raw_slots, self.coded_slots = new_slots(), new_slots()
        self.raw = PointerTable.from_tensors(self.raw_hosts, self.raw_slots)
        self.coded = CodedTable(hosts=self.coded_hosts, slots=self.coded_slots, codes=list(self.codes.values()))

    def raw_bytes(self) -> int:
        return sum(h.nbytes for h in self.raw_hosts)

    def coded_bytes(self) -> int:
        return sum(h.nbytes for h in self.coded_hosts)


def plan(m: int, experts: int, slots: int, device: torch.device, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(experts, generator=gen)[:m].tolist()
    i32 = dict(dtype=torch.int32, device=device)
    pe = torch.tensor(chosen + [-1] * (slots - m), **i32)
    ps = torch.tensor(list(range(m)) + [-1] * (slots - m), **i32)
    return chosen, pe, ps, torch.tensor([m], **i32)


def bench_gather(tables: Tables, counts: list[int], link_gbs: float | None) -> list[dict]:
    out, dev = [], tables.device
    slots = tables.raw_slots[0].shape[0]
    row_bytes = sum(r[0].nbytes for r in tables.rows.values())
    coded_row = sum(c.nbytes for c in tables.codes.values())
    for m in counts:
        chosen, pe, ps, pc = plan(m, tables.raw_hosts[0].shape[0], slots, dev)
        raw = lambda: gather_rows(tables.raw, pe, ps, pc, slots)  # noqa: E731
        coded = lambda: gather_coded(tables.coded, pe, ps, pc, slots)  # noqa: E731
        raw()
        coded()
        for name, got in zip(tables.rows, tables.coded_slots):  # decoded == raw rows, bit for bit
            want = tables.rows[name][chosen].view(torch.int16)
            assert torch.equal(got[:m].cpu().view(torch.int16), want), f"decoded {name} differs"
        assert all(torch.equal(s[:m].cpu(), tables.rows[n][chosen]) for n, s in zip(tables.rows, tables.raw_slots))
        t_raw, t_coded = timed(raw, dev), timed(coded, dev)
        delivered = m * row_bytes
        gbs = lambda ms: delivered / ms / 1e6  # noqa: E731
        row = dict(experts=m, delivered_mb=delivered / 1e6, read_mb_coded=m * coded_row / 1e6,
                   raw_gbs=gbs(t_raw), coded_gbs=gbs(t_coded), coded_over_raw=t_raw / t_coded)
        if link_gbs:
            row.update(memcpy_gbs=link_gbs, raw_over_memcpy=gbs(t_raw) / link_gbs,
                       coded_over_memcpy=gbs(t_coded) / link_gbs)
        out.append(row)
    return out


def cuda_layers(rows: dict[str, torch.Tensor], paged: bool = True):
    """The HF experts of ``rows`` on CUDA: unpaged, paged raw and paged compressed (cuda backend, K slots)."""
    from bench.common import hf_experts

    unpaged = hf_experts(device="cuda").requires_grad_(False)
    with torch.no_grad():
        for n, r in rows.items():
            getattr(unpaged, n).copy_(r)
    if not paged:
        return (unpaged,)
    import moepage

    raw, coded = copy.deepcopy(unpaged), copy.deepcopy(unpaged)
    moepage.wrap(raw, resident=K, backend="cuda")
    moepage.wrap(coded, resident=K, backend="cuda", compress=True)
    return unpaged, raw, coded


def bench_page_in(layers, counts: list[int]) -> list[dict]:
    """Host-planned page-ins of experts K..K+m-1 into slots 0..m-1 through each store, straight (the residency
    is left alone: the slots are refreshed with what it says they hold afterwards)."""
    import moepage

    out = []
    _, raw, coded = layers
    for m in counts:
        loads = [(e, s) for s, e in enumerate(range(K, K + m))]
        times = {}
        for name, module in (("raw", raw), ("coded", coded)):
            layer = next(moepage.paged_layers(module))
            times[name] = common.time_ms(lambda: layer.store.page_in(layer.name, loads))
            for n in layer.specs:  # what was paged in is each expert's row, bit for bit
                got = layer.store.slots(layer.name, n)[:m].cpu()
                assert torch.equal(got, torch.stack([layer.store.read_row(layer.name, n, e) for e, _ in loads]))
            layer.pager.refresh_slots()
        delivered = m * sum(s.nbytes for s in next(moepage.paged_layers(raw)).specs.values())
        out.append(dict(experts=m, raw_copy_gbs=delivered / times["raw"] / 1e6,
                        coded_decode_gbs=delivered / times["coded"] / 1e6,
                        coded_over_raw=times["raw"] / times["coded"]))
    return out


def bench_decode_step(layers, tokens=(1, 4, 8), reps: int = 20) -> list[dict]:
    """A captured decode step at 100 % hits (routing over experts 0..K-1, resident since wrap)."""
    import moepage

    out = []
    unpaged, raw, coded = layers
    for t in tokens:
        x = torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(K)[:TOP_K] for _ in range(t)]).cuda()
        w = torch.rand(t, TOP_K, device="cuda", dtype=torch.bfloat16)
        want = unpaged(x, idx, w)
        us = {}
        for name, module in (("unpaged", unpaged), ("raw", raw), ("coded", coded)):
            assert torch.equal(module(x, idx, w), want), f"{name} differs from unpaged"
            graph = common.graph_of(lambda m=module: m(x, idx, w), reps)
            us[name] = common.time_ms(graph.replay) * 1e3 / reps
        out.append(dict(tokens=t, unpaged_us=us["unpaged"], raw_us=us["raw"], coded_us=us["coded"],
                        raw_over_unpaged=us["raw"] / us["unpaged"], coded_over_unpaged=us["coded"] / us["unpaged"]))
    for module in (raw, coded):
        assert moepage.stats(module).total.misses == 0, "a 100 %-hit step paged something in"
    return out


def bench_stack_decode(rows: dict[str, torch.Tensor], layers: int, link_gbs: float, kfracs=(0.25, 0.5),
                       batches=(1, 8), steps: int = 16) -> list[dict]:
    """Table e (module doc): each configuration's whole decode step is one CUDA graph, replayed once per step."""
    import gc

    import moepage

    unpaged = cuda_layers(rows, paged=False)[0]
    stack_u = [unpaged] + [copy.deepcopy(unpaged) for _ in range(layers - 1)]
    expert_bytes = sum(r[0].nbytes for r in rows.values())
    out = []
    for b in batches:
        gen = torch.Generator(device="cuda").manual_seed(b)
        ids = torch.rand(steps, layers, b, E, device="cuda", generator=gen).argsort(-1)[..., :TOP_K]
        ws = torch.rand(steps, layers, b, TOP_K, device="cuda", generator=gen).to(torch.bfloat16)
        xs = torch.randn(steps, b, 2048, device="cuda", generator=gen).to(torch.bfloat16)
        buf_x, buf_i, buf_w = xs[0].clone(), ids[0].clone(), ws[0].clone()

        def step(stack):
            x = buf_x
            for l_, m in enumerate(stack):
                x = x + m(x, buf_i[l_], buf_w[l_])
            return x

        def fill(i):
            buf_x.copy_(xs[i]), buf_i.copy_(ids[i]), buf_w.copy_(ws[i])

        want = []
        for i in range(steps):
            fill(i)
            want.append(step(stack_u).clone())
        graph_u, out_u = common.capture(lambda: step(stack_u))
        ms_u = common.time_ms(graph_u.replay)
        for frac in kfracs:
            k = int(E * frac)
            row = dict(batch=b, k_over_e=frac, k=k, unpaged_ms=ms_u)
            for name, compress in (("raw", False), ("coded", True)):
                stack = [copy.deepcopy(m) for m in stack_u]
                for m in stack:
                    moepage.wrap(m, resident=k, backend="cuda", compress=compress)
                fill(0)
                step(stack)  # the eager step moepage checks the implementation on
                graph, result = common.capture(lambda st=stack: step(st))
                before = sum(moepage.stats(m).total.misses for m in stack)
                times, equal = [], True
                for i in range(steps):
                    fill(i)
                    a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    graph.replay()
                    z.record()
                    z.synchronize()
                    times.append(a.elapsed_time(z))
                    equal &= torch.equal(result, want[i])
                misses = (sum(moepage.stats(m).total.misses for m in stack) - before) / steps
                row[f"{name}_ms"] = sum(times) / steps
                row[f"{name}_equal"] = equal
                if name == "raw":
                    row["misses_per_step"] = misses
                    row["bound_ms"] = ms_u + misses * expert_bytes / link_gbs / 1e6
                del stack, graph, result
                gc.collect()
                torch.cuda.empty_cache()
            row.update(raw_over_bound=row["raw_ms"] / row["bound_ms"],
                       coded_over_bound=row["coded_ms"] / row["bound_ms"],
                       coded_speedup=row["raw_ms"] / row["coded_ms"],
                       raw_tok_s=b * 1e3 / row["raw_ms"], coded_tok_s=b * 1e3 / row["coded_ms"])
            out.append(row)
            if not (row["raw_equal"] and row["coded_equal"]):
                raise SystemExit(f"a paged step differs from unpaged: {row}")
    return out


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", default="64,32,8", help="experts per plan in tables a and b (each <= 64)")
    ap.add_argument("--tiny", action="store_true", help="table a on small rows on the CPU, Triton interpreted")
    ap.add_argument("--json", help="write every table here")
    ap.add_argument("--stack-layers", type=int, default=4, help="layers of table e's decode stack")
    ap.add_argument("--only", default="abcde", help="the tables to run (letters)")
    args = ap.parse_args(argv)
    args.counts = [int(x) for x in args.experts.split(",")]
    if not all(1 <= m <= K for m in args.counts):
        ap.error(f"--experts: each count must be in 1..{K}")
    return args


def main(argv=None) -> dict | None:
    args = parse(argv)
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # read at launch (kernels decorate lazily per mode)
        tables = Tables(rows=layer_rows(TINY, 16), slots=8, device=torch.device("cpu"))
        results = {"a_gather": bench_gather(tables, [m for m in args.counts if m <= 8] or [8], None),
                   "d_host_bytes": [dict(raw_mb=tables.raw_bytes() / 1e6, coded_mb=tables.coded_bytes() / 1e6,
                                         ratio=tables.raw_bytes() / tables.coded_bytes())]}
    elif not torch.cuda.is_available():
        print("SKIPPED: bench.kernels.compress_bench needs a CUDA GPU (--tiny runs a CPU smoke test)")
        return None
    else:
        rows = layer_rows(Q3, E)
        link = common.memcpy_gbs(1 << 30)  # one 1 GiB pinned copy: the link's peak, this run
        results = {}
        if set("ad") & set(args.only):
            tables = Tables(rows=rows, slots=K, device=torch.device("cuda"))
            if "a" in args.only:
                results["a_gather"] = bench_gather(tables, args.counts, link)
            if "d" in args.only:
                results["d_host_bytes"] = [dict(raw_mb=tables.raw_bytes() / 1e6, coded_mb=tables.coded_bytes() / 1e6,
                                                ratio=tables.raw_bytes() / tables.coded_bytes())]
            del tables
            torch.cuda.empty_cache()
        if set("bc") & set(args.only):
            layers = cuda_layers(rows)
            if "b" in args.only:
                results["b_page_in"] = bench_page_in(layers, args.counts)
            if "c" in args.only:
                with torch.no_grad():
                    results["c_decode_step"] = bench_decode_step(layers)
            del layers
            torch.cuda.empty_cache()
        if "e" in args.only:
            with torch.no_grad():
                results["e_stack_decode"] = bench_stack_decode(rows, args.stack_layers, link)
    print(common.versions())
    for name, rows_ in results.items():
        print(f"\n### {name}\n{common.table(rows_)}")
    common.write_json(args.json, dict(versions=common.versions(), **results))
    return results


if __name__ == "__main__":
    main()
