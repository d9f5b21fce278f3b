"""Trials of the planner and gather kernels against the host rule and plain copies, on any device."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from moepage import compress as C
from moepage.kernels import gather as G
from moepage.kernels import planner as P
from moepage.kernels import ranks as R
from moepage.residency import LRU, POLICIES, Policy, Residency, plan_waves


def rules() -> list[Policy]:
    """What the host, torch and Triton planners must agree on: every named policy (``residency.POLICIES``, so a new
    one is tested once it is named), and both key orders at half-lives whose decay fires often."""
    return [*POLICIES.values(), *(Policy(f"h{h}{'-recency' * r}", h, r) for h in (1, 3) for r in (False, True)),
            Policy("lru-recency", 0, True)]


RULES = rules()


def new_state(e: int, k: int, device: str = "cpu", policy: Policy = LRU) -> dict[str, torch.Tensor]:
    table = torch.tensor(Residency(e, k).table(), dtype=torch.int64, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    return {
        "table": table,
        "policy": policy,
        "slot_expert": table[:k],
        "expert_slot": table[k : k + e],
        "last_use": table[k + e : 2 * k + e],
        "clock": table[2 * k + e : 2 * k + e + 1],
        "score": table[2 * k + e + 1 :],
        "plan_experts": torch.full((k,), -1, **i32),
        "plan_slots": torch.full((k,), -1, **i32),
        "plan_count": torch.zeros(1, **i32),
        "counters": torch.zeros(4, dtype=torch.int64, device=device),
    }


def run_plan(fn: Callable, ids: torch.Tensor, st: dict[str, torch.Tensor], **kw) -> None:
    state = P.PlannerState(st["slot_expert"], st["expert_slot"], st["last_use"], st["clock"], st["score"],
                           st["policy"])
    fn(ids, state, P.PlanBuffers(st["plan_experts"], st["plan_slots"], st["plan_count"], st["counters"]), **kw)


def host_copy(st: dict[str, torch.Tensor], e: int, k: int) -> Residency:
    ref = Residency(e, k, st["policy"])
    ref.load_table(st["table"].tolist())
    return ref


def reference_step(st: dict[str, torch.Tensor], ids: torch.Tensor, e: int, k: int) -> tuple[Residency, list, int]:
    ref = host_copy(st, e, k)
    waves = plan_waves(ref, sorted({i for i in ids.flatten().tolist() if 0 <= i < e}))
    assert len(waves) <= 1
    return ref, list(waves[0].loads) if waves else [], waves[0].hits if waves else 0


def check_step(st: dict[str, torch.Tensor], ref: Residency, loads: list, counters: list[int]) -> None:
    assert st["table"].tolist() == ref.table()
    n = len(loads)
    assert int(st["plan_count"][0]) == n
    assert st["plan_experts"].tolist() == [x for x, _ in loads] + [-1] * (len(ref.slot_expert) - n)
    assert st["plan_slots"].tolist() == [s for _, s in loads] + [-1] * (len(ref.slot_expert) - n)
    assert st["counters"].tolist() == counters


def check_out(out: torch.Tensor, ids: torch.Tensor, ref: Residency, wave_experts, pad: int) -> None:
    """Every entry of the wave gets its expert's slot after the placement, every other ``pad``."""
    want = [ref.expert_slot[i] if i in wave_experts else pad for i in ids.flatten().tolist()]
    assert out.flatten().tolist() == want
    assert out.dtype == ids.dtype and out.shape == ids.shape


def random_ids(rng: random.Random, e: int, k: int, top_k: int, hot: list[int],
               max_tokens: int | None = None) -> torch.Tensor:
    t = rng.randint(0, k // top_k if max_tokens is None else max_tokens)
    if rng.random() < 0.1:  # all padding
        vals = [rng.choice([-1, e, e + 7, -5]) for _ in range(t * top_k)]
    else:
        vals = []
        for _ in range(t * top_k):
            r = rng.random()
            vals.append(rng.choice([-1, e]) if r < 0.15 else rng.choice(hot) if r < 0.6 else rng.randrange(e))
    dtype = rng.choice([torch.int64, torch.int32, torch.int16])
    return torch.tensor(vals, dtype=dtype).reshape(t, top_k)


def advance(counters: list[int], first: bool, hits: int, loads: list) -> list[int]:
    return [counters[0] + first, counters[1] + (hits + len(loads) > 0), counters[2] + hits, counters[3] + len(loads)]


def invalidate_some(rng: random.Random, st: dict[str, torch.Tensor], e: int, k: int) -> None:
    """What a failed host page-in leaves: empty slots (stamp -1), which must be taken first."""
    ref = host_copy(st, e, k)
    ref.invalidate(rng.sample(range(k), rng.randint(1, k)))
    st["table"].copy_(torch.tensor(ref.table()))


def planner_trial(fn: Callable, rng: random.Random, e: int, k: int, top_k: int, steps: int, device: str,
                  policy: Policy = LRU) -> None:
    st = new_state(e, k, device, policy)
    hot = rng.sample(range(e), max(1, min(e, k // 2)))
    counters = [0, 0, 0, 0]
    for _ in range(steps):
        if rng.random() < 0.15:
            invalidate_some(rng, st, e, k)
        ids = random_ids(rng, e, k, top_k, hot)
        ref, loads, hits = reference_step(st, ids, e, k)
        pad = rng.choice([-1, k])
        out = torch.empty_like(ids, device=device)
        run_plan(fn, ids.to(device), st, out=out, pad=pad)
        counters = advance(counters, True, hits, loads)
        check_step(st, ref, loads, counters)
        check_out(out.cpu(), ids, ref, {i for i in ids.flatten().tolist() if 0 <= i < e}, pad)


def multiwave_trial(fn: Callable, rng: random.Random, e: int, k: int, top_k: int, steps: int,
                    policy: Policy = LRU, ranks_fn: Callable = R.step_ranks_torch, width: int | None = None) -> None:
    """Steps of more than K distinct experts: ``step_ranks`` then one planner call per wave, each
    matching ``plan_waves``'s wave on the host state (policy included), entry slots included; waves of
    ``width`` (overlapped: narrower than K) as ``plan_waves``'s ``wave_size``."""
    w_size = width or k
    st = new_state(e, k, policy=policy)
    hot = rng.sample(range(e), max(1, min(e, k // 2)))
    counters = [0, 0, 0, 0]
    for _ in range(steps):
        if rng.random() < 0.15:
            invalidate_some(rng, st, e, k)
        ids = random_ids(rng, e, k, top_k, hot, max_tokens=3 * k // top_k + 2)
        ref = host_copy(st, e, k)
        waves = plan_waves(ref, sorted({i for i in ids.flatten().tolist() if 0 <= i < e}), width)
        n = max(1, -(-min(e, ids.numel()) // w_size))
        assert len(waves) <= n
        ranks = ranks_fn(ids, st["expert_slot"])
        replay = host_copy(st, e, k)
        for w in range(n):
            out = torch.empty_like(ids)
            run_plan(fn, ids, st, out=out, pad=k, ranks=ranks, wave=w, width=width)
            experts = waves[w].experts if w < len(waves) else ()
            loads, hits = (list(waves[w].loads), waves[w].hits) if w < len(waves) else ([], 0)
            if experts:
                assert replay.place(experts, None, waves[w - 1].slots if w else ()) == waves[w]
                if width is not None and w:  # an overlapped wave pages nothing into the previous wave's slots
                    assert not {s for _, s in loads} & set(waves[w - 1].slots)
            counters = advance(counters, w == 0, hits, loads)
            check_step(st, replay, loads, counters)
            check_out(out, ids, replay, set(experts), k)
        assert replay.table() == ref.table()


def rank_cases(rng: random.Random):
    """Routings with padding of every kind, repeats, steps past one read chunk, E not a power of two, and tables
    all resident, none resident or mixed."""
    for e, n in [(8, 3), (12, 40), (128, 256), (100, 1500), (512, 2049), (3, 5)]:
        for table in ("mixed", "all", "none"):
            expert_slot = torch.full((e,), -1, dtype=torch.int64)
            chosen = rng.sample(range(e), {"mixed": e // 3, "all": e, "none": 0}[table])
            expert_slot[chosen] = torch.randperm(len(chosen))
            ids = torch.tensor([rng.choice([rng.randrange(e), rng.randrange(e), -1, e, e + 7]) for _ in range(n)])
            yield (ids.view(-1, 2) if n % 2 == 0 else ids.view(-1, 1)), expert_slot
    yield torch.full((4, 2), -1), torch.arange(6)  # every entry padding
    yield torch.tensor([[200, 3], [3, 9]], dtype=torch.uint8), torch.tensor([-1, 2, -1, 0, 1, -1, -1, -1, -1, 3])
    yield torch.tensor([[2**40, 5], [-(2**40), 1]]), torch.tensor([0, -1, -1, -1, -1, 1])




def planner_cases(seed: int, n: int) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        e = rng.choice([8, 32, 128])
        top_k = min(e, rng.choice([1, 2, 8]))
        k = rng.choice([top_k, (top_k + e) // 2, e])
        cases.append((e, k, top_k))
    return cases


ROW_SHAPES = [((4,), torch.uint8), ((3,), torch.float32), ((7,), torch.uint8), ((1001,), torch.uint8),
              ((8, 16), torch.bfloat16), ((5,), torch.int64), ((2, 3), torch.float16)]


def make_tensors(e: int, k: int, specs: list, device: str = "cpu", pin: bool = False,
                 misalign: int = -1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(e * 1000 + k)
    hosts, slots = [], []
    for j, (shape, dtype) in enumerate(specs):
        nbytes = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
        off = 1 if j == misalign else 0  # a host base that is not 16-byte aligned
        buf = torch.randint(0, 256, (e * nbytes + off,), dtype=torch.uint8, generator=g)
        if pin:
            buf = buf.pin_memory()
        # An unaligned view cannot be reinterpreted as a wider dtype, so it stays bytes.
        host = buf[off:].view(e, nbytes) if off else buf.view(dtype).view(e, *shape)
        hosts.append(host)
        slot = torch.randint(0, 256, (k * host[0].numel() * host.element_size(),), dtype=torch.uint8, generator=g)
        slots.append(slot.view(host.dtype).view(k, *host.shape[1:]).to(device))
    return hosts, slots


def random_plan(rng: random.Random, e: int, k: int, count: int, device: str) -> tuple[torch.Tensor, ...]:
    experts = rng.sample(range(e), count) + [rng.choice([-1, rng.randrange(e)]) for _ in range(k - count)]
    slots = rng.sample(range(k), count) + [rng.choice([-1, rng.randrange(k)]) for _ in range(k - count)]
    i32 = dict(dtype=torch.int32, device=device)
    return torch.tensor(experts, **i32), torch.tensor(slots, **i32), torch.tensor([count], **i32)


def expected_slots(hosts: list, slots: list, pe: torch.Tensor, ps: torch.Tensor, count: int) -> list[torch.Tensor]:
    out = [s.cpu().clone() for s in slots]
    for h, o in zip(hosts, out):
        for i in range(count):
            o[int(ps[i])] = h[int(pe[i])].cpu()
    return out


def assert_bytes_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g_, w in zip(got, want):
        assert torch.equal(g_.cpu().view(torch.uint8), w.view(torch.uint8))


def gather_trials(impl: str, device: str, pin: bool, e: int = 9, k: int = 6, misalign: int = 4) -> None:
    rng = random.Random(5)
    for count in [0, k, 1, 3, k - 1, 2]:
        max_count = k if count in (0, k) or rng.random() < 0.5 else max(count, rng.randint(count, k))
        hosts, slots = make_tensors(e, k, ROW_SHAPES, device, pin, misalign)
        pe, ps, pc = random_plan(rng, e, k, count, device)
        want = expected_slots(hosts, slots, pe, ps, count)
        if impl == "triton":
            G.gather_rows(G.PointerTable.from_tensors(hosts, slots), pe, ps, pc, max_count)
        else:
            G.gather_rows_torch([h.to(device) for h in hosts], slots, pe, ps, pc, max_count)
        assert_bytes_equal(slots, want)


def check_resident_rows(hosts: list, slots: list, slot_expert: torch.Tensor) -> None:
    for h, s in zip(hosts, slots):
        for slot, ex in enumerate(slot_expert.tolist()):
            if ex >= 0:
                assert torch.equal(s[slot].cpu().view(torch.uint8), h[ex].cpu().view(torch.uint8))


# -- coded rows (moepage.compress) for the decode kernel ------------------------------------------
CODED_ALIGNED = [(64, 32), (16, 1000), (20480,)]  # rows of a multiple of 8 weights; the last spans two chunks
CODED_UNALIGNED = [(33, 67), (5001,), (3, 7, 11)]  # odd sizes: byte accesses, a half-filled last code byte


def coded_rows(e: int, shape: tuple[int, ...], seed: int, escapes: bool = True) -> tuple[torch.Tensor, C.TensorCode]:
    """``e`` rows of random signs and mantissas over 15 exponents, with (``escapes``) a few odd
    values outside them at random places and at both ends; without, no exception list."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-(1 << 15), 1 << 15, (e, *shape), generator=g, dtype=torch.int32).view(e, -1)
    words = (words & ~(0xFF << 7)) | (torch.randint(110, 125, words.shape, generator=g, dtype=torch.int32) << 7)
    words = words.to(torch.int16)
    if escapes:
        odd = torch.tensor([0x7F80, 0xFFC1, 0x0001, 0x8000], dtype=torch.int32).to(torch.int16)  # inf, NaN, tiny, -0
        for r in range(e):
            at = torch.randperm(words.shape[1], generator=g)[: r % 4]
            words[r, at] = odd[: at.numel()]
        words[0, 0], words[e - 1, -1] = odd[0], odd[1]
    rows = words.view(torch.bfloat16).view(e, *shape)
    coding = C.plan_code(rows, chunk=3)
    assert coding.code is not None, coding.why
    assert (coding.code.layout.capacity > 0) == escapes
    return rows, coding.code


def coded_layer(e: int, k: int, shapes, seed: int, device: str = "cpu", pin: bool = False):
    """Coded host rows of tensors of ``shapes`` (the second without escapes), their sources and
    codes, and random slots."""
    sources, hosts, slots, codes = [], [], [], []
    for j, shape in enumerate(shapes):
        rows, code = coded_rows(e, shape, seed + j, escapes=j != 1)
        sources.append(rows)
        packed = C.encode_rows(rows, code)
        hosts.append(packed.pin_memory() if pin else packed)
        slot = torch.randint(-(1 << 15), 1 << 15, (k, *shape), dtype=torch.int16).view(torch.bfloat16)
        slots.append(slot.to(device))
        codes.append(code)
    return sources, hosts, slots, codes


def expected_decoded(sources, slots, pe, ps, count) -> list[torch.Tensor]:
    out = [s.cpu().clone() for s in slots]
    for src, o in zip(sources, out):
        for i in range(count):
            o[int(ps[i])] = src[int(pe[i])]
    return out
