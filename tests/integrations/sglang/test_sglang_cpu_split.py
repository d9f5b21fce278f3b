"""A CPU share in SGLang (``--paged-experts-cpu-share``): real FusedMoE layers of real model classes, paged with part
of each step's misses computed on the CPU, against the unpaged layers (within the split's tolerance); with a disk tier
and coded rows; every routed expert counted once; a cost model that declines leaves steps bit-exact; full decode
graphs, quantized formats and bad values refused at startup, naming the flag."""

from __future__ import annotations

import random

import pytest
import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)
import torch

import moepage  # noqa: E402
from helpers import sglang as H  # noqa: E402
from helpers.sglang import K, build_pair, forward  # noqa: E402
from moepage.errors import ConfigError  # noqa: E402
from moepage.split import Costs  # noqa: E402

TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}  # relative to the largest output (docs/cpu-split.md)


@pytest.fixture(scope="module", autouse=True)
def sglang_process():
    H.setup_sglang()


def split_args(share="1.0", **more):
    return dict(_moepage_paged_experts_cpu_share=share, **more)


def steps(ref, paged, dtype, exact: bool = False, count: int = 4):
    """Steps of one and several waves through each layer pair: equal to unpaged (bit for bit where ``exact``, else
    within the tolerance), every routed expert a hit, a miss or a CPU expert."""
    rng = random.Random(3)
    for r, p in zip(H.moe_layers(ref), H.moe_layers(paged)):
        pager = p.quant_method.pager
        for i in range(count):
            distinct = rng.randint(2, 8)
            ids = H.routing(rng, rng.randint(max(1, (distinct + 1) // 2), 9), distinct)
            x = torch.randn(ids.shape[0], H.HIDDEN, generator=torch.Generator().manual_seed(i)).to(dtype)
            topk = H.topk_output(ids, seed=i)
            before = pager.read_stats()
            got, want = forward(p, x, topk), forward(r, x, topk)
            after = pager.read_stats()
            assert (after.hits + after.misses + after.cpu) - (before.hits + before.misses + before.cpu) == distinct
            if exact:
                assert torch.equal(got, want)
            else:
                scale = want.float().abs().max().item()
                assert (got.float() - want.float()).abs().max().item() <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("share", ["1.0", "0.5"])
@pytest.mark.parametrize("kind, dtype", [("qwen3_moe", torch.bfloat16), ("mixtral", torch.float32)])
def test_split_steps_equal_unpaged_within_the_tolerance(kind, dtype, share):
    ref, paged = build_pair(kind, dtype, **split_args(share))
    steps(ref, paged, dtype)
    assert moepage.integrations.sglang.stats(paged).total.cpu > 0


def test_a_cost_model_that_declines_leaves_the_steps_bit_exact():
    ref, paged = build_pair("qwen3_moe", torch.bfloat16, **split_args("auto"))
    for p in H.moe_layers(paged):
        split = p.quant_method.pager.split
        assert split.costs is not None  # measured at startup
        split.costs = Costs(1e-6, (1,), (1.0,))  # a CPU far slower than the link
    steps(ref, paged, torch.bfloat16, exact=True)
    assert moepage.integrations.sglang.stats(paged).total.cpu == 0


@pytest.mark.parametrize("compress", [False, True])
def test_with_a_disk_tier_and_coded_rows(compress, tmp_path):
    more = dict(_moepage_paged_experts_host_budget="4", _moepage_paged_experts_spill_dir=str(tmp_path),
                _moepage_paged_experts_compress=compress or None)
    ref, paged = build_pair("qwen3_moe", torch.bfloat16, **split_args("0.5", **more))
    assert H.moe_layers(paged)[0].quant_method.rows.tier is not None
    steps(ref, paged, torch.bfloat16)
    assert moepage.integrations.sglang.stats(paged).total.cpu > 0


@pytest.mark.parametrize("setup, says", [
    (dict(decode="full", bs=[1, 2]), "--paged-experts-cpu-share / MOEPAGE_CPU_SHARE: a split step is planned on the "
                                     "host, which a full decode CUDA graph cannot replay"),
    (dict(share="most"), "--paged-experts-cpu-share / MOEPAGE_CPU_SHARE: 'most' is not off, auto or a share"),
    (dict(quant=True), "--paged-experts-cpu-share / MOEPAGE_CPU_SHARE: its experts are quantized"),
])
def test_what_cannot_split_is_refused_at_startup_naming_the_flag(setup, says):
    setup = dict(setup)
    share, quant = setup.pop("share", "auto"), setup.pop("quant", False)
    with H.server_args(**H.paged_args(**split_args(share))), H.admitted():
        H.graph_config(**setup)
        with pytest.raises(ConfigError) as err:
            H.bare_layer(quant_config=H.fp8_config() if quant else None)
    assert says in str(err.value)


def test_eager_decode_and_breakable_prefill_serve_it():
    with H.server_args(**H.paged_args(**split_args("auto"))):
        H.graph_config(decode="disabled", prefill="breakable")
        layer = H.bare_layer()
    assert layer.quant_method.config.cpu_share == "auto" and K <= 8


def test_a_split_step_under_the_breakable_prefill_graph_is_an_eager_break(monkeypatch):
    """Even a step of at most K entries (else planned on the device, which a capture takes) goes through SGLang's
    eager break: a split is planned on the host."""
    from moepage.integrations.sglang import compat as graphs
    from moepage.integrations.sglang.method import PagedMoeMethod

    ref, paged = build_pair("qwen3_moe", torch.bfloat16, **split_args("1.0"))
    r, p = H.moe_layers(ref)[0], H.moe_layers(paged)[0]
    calls = []
    impl = PagedMoeMethod._eager_waves_impl
    monkeypatch.setattr(graphs, "in_breakable_graph", lambda: True)
    monkeypatch.setattr(PagedMoeMethod, "_eager_waves", lambda self, *a: (calls.append(1), impl(self, *a)))
    ids = H.routing(random.Random(1), 1, 2)  # one token: 2 entries <= K
    x = torch.randn(1, H.HIDDEN, dtype=torch.bfloat16)
    got, want = forward(p, x, H.topk_output(ids)), forward(r, x, H.topk_output(ids))
    assert calls == [1] and (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
