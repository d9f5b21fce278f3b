"""CUDA backend benchmark (issue 3): run on a CUDA GPU, prints markdown tables.

a. device gather GB/s / one large cudaMemcpyAsync GB/s (and per-row copies), same run;
b. planner latency per layer, captured;
c. paged MoE decode layer at 100% hit, captured, / unpaged (Qwen3-30B-A3B expert shapes);
d. host RSS / expert bytes for a 48-layer Qwen3-30B-A3B-shaped store, cuda vs torch pin_memory.

    python -m bench.kernels.cuda_bench [--layers 48] [--skip-rss] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy

import torch

import moepage
from bench.common import graph_of, hf_experts, table, time_ms, write_json
from moepage.backends.cuda import CudaStore
from moepage.backends.protocol import RowSpec
from moepage.backends.torch import TorchStore
from moepage.kernels import plan_step_torch, plan_step_triton
from moepage.kernels.gather import gather_rows

DEV = torch.device("cuda")


def bench_gather(rows_mb=(0.6, 2.4, 9.4), experts: int = 64) -> list[dict]:
    out = []
    for mb in rows_mb:
        row = int(mb * 1e6) // 16 * 16
        store = CudaStore()
        store.allocate("g", {"w": RowSpec((row,), torch.uint8)}, experts, experts, DEV)
        host = store.host_rows("g", "w")
        host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8))
        slots = store.slots("g", "w")
        perm = torch.randperm(experts)
        pe = perm.to(torch.int32).to(DEV)
        ps = torch.arange(experts, dtype=torch.int32, device=DEV)
        count = torch.tensor([experts], dtype=torch.int32, device=DEV)
        total = row * experts
        flat_host, flat_dev = host.view(-1), slots.view(-1)

        def gather():
            gather_rows(store.gatherer.table("g"), pe, ps, count, experts)

        def one_copy():
            flat_dev.copy_(flat_host, non_blocking=True)

        def per_row():
            for i in range(experts):
                slots[i].copy_(host[int(perm[i])], non_blocking=True)

        gather()
        torch.cuda.synchronize()
        assert torch.equal(slots.cpu(), host[perm]), "gather copied wrong bytes"
        t_gather, t_copy, t_rows = (time_ms(f) for f in (gather, one_copy, per_row))
        gbs = lambda ms: total / ms / 1e6
        out.append(
            dict(row_mb=mb, total_mb=total / 1e6, gather_gbs=gbs(t_gather), memcpy_gbs=gbs(t_copy),
                 per_row_gbs=gbs(t_rows), ratio=t_copy / t_gather, per_row_ratio=t_copy / t_rows)
        )
        store.close()
    return out


def bench_planner(e: int = 128, k: int = 64, top_k: int = 8, n: int = 200) -> list[dict]:
    out = []
    for name, fn in (("triton", plan_step_triton), ("torch", plan_step_torch)):
        st = moepage.pager.DeviceResidency(moepage.Residency(e, k), DEV)
        ids = torch.randint(0, e, (1, top_k), device=DEV)
        entry_slots = torch.empty_like(ids)

        def step():
            fn(ids, st.state, st.step_plan, out=entry_slots, pad=k)

        g = graph_of(step, n)
        ms = time_ms(g.replay)
        out.append(dict(planner=name, us_per_layer=ms * 1e3 / n))
    return out


# (name, hidden, expert intermediate, E, top_k, K, token counts) of the decode-layer comparison
DECODE_SHAPES = (
    ("Qwen3-30B-A3B", 2048, 768, 128, 8, 64, (1, 4, 8)),
    ("Mixtral-8x7B", 4096, 14336, 8, 2, 4, (1,)),
)


def bench_decode_layer() -> list[dict]:
    """A paged decode layer at 100 % hits (routing over the K resident experts), captured, against
    the unpaged layer captured the same way; outputs checked ``torch.equal`` first."""
    out = []
    for model, hidden, inter, e, top_k, k_slots, tokens in DECODE_SHAPES:
        unpaged = hf_experts(hidden, inter, e, top_k, device=DEV).requires_grad_(False)
        for p in unpaged.parameters():
            torch.nn.init.normal_(p, std=0.02)
        paged = copy.deepcopy(unpaged)
        moepage.wrap(paged, resident=k_slots, backend=CudaStore())
        for t in tokens:
            x = torch.randn(t, hidden, device=DEV, dtype=torch.bfloat16)
            resident = torch.arange(k_slots)  # experts 0..K-1 start resident: 100% hits
            idx = torch.stack([resident[torch.randperm(k_slots)[:top_k]] for _ in range(t)]).to(DEV)
            w = torch.rand(t, top_k, device=DEV, dtype=torch.bfloat16)
            assert torch.equal(paged(x, idx, w), unpaged(x, idx, w))
            reps = 20
            g_un = graph_of(lambda: unpaged(x, idx, w), reps)
            g_pg = graph_of(lambda: paged(x, idx, w), reps)
            un, pg = time_ms(g_un.replay), time_ms(g_pg.replay)
            out.append(dict(model=model, tokens=t, K=k_slots, unpaged_us=un * 1e3 / reps, paged_us=pg * 1e3 / reps,
                            ratio=pg / un))
        stats = moepage.stats(paged).total
        assert stats.misses == 0, stats
        moepage.unwrap(paged)  # its slots and host rows go; the next shapes' layers replace these
        torch.cuda.empty_cache()
    return out


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def bench_rss(layers: int) -> list[dict]:
    specs = {"gate_up_proj": RowSpec((1536, 2048), torch.bfloat16), "down_proj": RowSpec((2048, 768), torch.bfloat16)}
    out = []
    for name, make in (("cuda (cuMemHostAlloc)", CudaStore), ("torch pin_memory", lambda: TorchStore(pin_memory=True))):
        before = rss_bytes()
        store = make()
        for i in range(layers):
            store.allocate(f"layer{i}", specs, 128, 1, DEV)
        expert_bytes = store.host_bytes()
        grown = rss_bytes() - before
        out.append(dict(store=name, layers=layers, expert_gb=expert_bytes / 1e9, rss_gb=grown / 1e9,
                        ratio=grown / expert_bytes))
        store.close()
        del store
        torch.cuda.empty_cache()
        torch._C._host_emptyCache() if hasattr(torch._C, "_host_emptyCache") else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    results = {
        "a_gather": bench_gather(),
        "b_planner": bench_planner(),
        "c_decode_layer": bench_decode_layer(),
    }
    if not args.skip_rss:
        results["d_host_rss"] = bench_rss(args.layers)
    for name, rows in results.items():
        print(f"\n### {name}\n{table(rows)}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
