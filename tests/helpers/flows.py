"""Kinds of steps a serving engine interleaves, and routing that gives each its shape."""

from __future__ import annotations

import copy
import random

import torch

import moepage
from helpers.reference import RefLRU, assert_matches_ref
from moepage.integrations.transformers.decode import greedy

KINDS = ("host1", "host2", "hostmany", "device", "devicemany")


def distinct_for(kind: str, rng: random.Random, e: int, k: int, top_k: int) -> int | None:
    """How many distinct experts a step of ``kind`` routes (None: impossible with these sizes)."""
    lo, hi = {"host1": (top_k, k), "host2": (k + 1, 2 * k), "hostmany": (2 * k + 1, e),
              "device": (top_k, k), "devicemany": (top_k, e)}[kind]
    hi = min(hi, e)
    return rng.randint(lo, hi) if lo <= hi else None


def tokens_for(kind: str, rng: random.Random, distinct: int, k: int, top_k: int) -> int:
    need = -(-distinct // top_k)  # enough entries to cover the pool
    if kind == "device":  # at most K entries: one device wave
        return rng.randint(need, max(need, k // top_k))
    # More than K entries: eager forward plans these on the host; device_forward in waves.
    return max(need, k // top_k + 1) + rng.randint(0, 3)


class Static:
    """A step's inputs in static buffers, captured once (warm-up and capture under capture_mode)."""

    def __init__(self, module, t: int, hidden: int, top_k: int, dtype, device):
        self.x = torch.zeros(t, hidden, dtype=dtype, device=device)
        self.idx = torch.zeros(t, top_k, dtype=torch.long, device=device)
        self.w = torch.zeros(t, top_k, dtype=dtype, device=device)
        self.module = module
        self.graph = None

    def fill(self, x, idx, w) -> None:
        self.x.copy_(x)
        self.idx.copy_(idx)
        self.w.copy_(w)

    def capture(self) -> torch.Tensor:
        """Warm up (one real step) on a side stream, then capture; returns the warm-up's output."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), moepage.capture_mode():
            warm = self.module(self.x, self.idx, self.w).clone()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with moepage.capture_mode(), torch.cuda.graph(self.graph):
            self.out = self.module(self.x, self.idx, self.w)
        return warm

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


# -- rounds of the serving flow, and static-cache decoding (CPU and GPU tests) -------------------
ROUNDS, REPLAYS = 30, 3


def routing_on(t: int, e: int, k: int, device, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(device)


def hf_experts(impl: str, e: int = 32, top_k: int = 4, dtype=torch.bfloat16, device="cuda", hidden: int = 256):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=hidden // 2, num_experts=e,
                         num_experts_per_tok=top_k)
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    module = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.05)
    return module.to(device, dtype), hidden


def rounds(paged, ref, e, top_k, hidden, dtype, gen, capture: bool, rounds: int = ROUNDS):
    """Eager steps, then captures of a one-wave and a three-wave step, then ``rounds`` rounds of
    one eager multi-wave step and ``REPLAYS`` replays of each graph on fresh routing (without
    ``capture``: eager device-planned steps of one and of three waves instead)."""
    layer = next(moepage.paged_layers(paged))
    dev = layer.pager.device
    lru = RefLRU(e, layer.num_slots)

    def check(out, x, idx, w):
        assert torch.equal(out, ref(x, idx, w))
        lru.step(idx.flatten().tolist())

    def fresh(t):
        return (torch.randn(t, hidden, device=dev, dtype=dtype, generator=None), routing_on(t, e, top_k, dev, gen),
                torch.rand(t, top_k, device=dev, dtype=dtype))

    for _ in range(3):
        x, idx, w = fresh(2)
        check(paged(x, idx, w), x, idx, w)
    graphs = []
    if capture:
        for t in (2, 6):  # 2 x top_k fits K = 8 (one wave); 6 x top_k = 24 entries: three waves
            g = Static(paged, t, hidden, top_k, dtype, dev)
            x, idx, w = fresh(t)
            g.fill(x, idx, w)
            check(g.capture(), x, idx, w)
            graphs.append(g)
    replays = 0
    for _ in range(rounds):
        x, idx, w = fresh(64)  # eager, planned on the host in several waves
        check(paged(x, idx, w), x, idx, w)
        for g in graphs:
            for _ in range(REPLAYS):
                x, idx, w = fresh(g.x.shape[0])
                g.fill(x, idx, w)
                check(g.replay().clone(), x, idx, w)
                replays += 1
        if not capture:  # eager device-planned steps instead
            for t in (2, 6):
                for _ in range(REPLAYS):
                    x, idx, w = fresh(t)
                    with moepage.capture_mode():
                        check(paged(x, idx, w), x, idx, w)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        assert_matches_ref(layer.read_residency(), lru)
        layer.check_slots()
    return replays


def tiny_qwen3_moe(impl: str, dtype, device):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=16, num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[],
                         max_position_embeddings=512)
    cfg._experts_implementation = impl
    cfg._attn_implementation = "eager"  # no value-dependent mask shortcut: capturable
    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # routing that varies between tokens
    return model.to(device, dtype).eval()


PROMPTS = [[5, 9, 17, 33, 2, 8, 71, 40, 3], list(range(3, 120, 5)), [11, 12, 13]]  # left-padded to 24


def decode_equal(device, dtype, graph: bool, backend: str, **wrap_kwargs):
    ref = tiny_qwen3_moe("grouped_mm" if device == "cuda" else "batched_mm", dtype, device)
    paged = copy.deepcopy(ref)
    moepage.wrap(paged, resident=8, backend=backend, **wrap_kwargs)
    tokens, logits = greedy(paged, PROMPTS, new_tokens=12, graph=graph)
    want_tokens, want_logits = greedy(ref, PROMPTS, new_tokens=12, graph=graph)
    assert torch.equal(tokens, want_tokens)
    assert len(logits) == len(want_logits) == 13
    for i, (a, b) in enumerate(zip(logits, want_logits)):
        assert torch.equal(a, b), f"decode step {i}"
    total = moepage.stats(paged).total
    # The prefill (3 x 24 tokens x top-4 >> K) ran in host waves, the decode steps on the device.
    assert total.misses > 0 and total.waves > total.steps
    assert len(set(tokens.flatten().tolist())) > 6  # the tokens vary: the routing does too
    return paged
