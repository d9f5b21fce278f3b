"""SGLang's tensor and expert parallelism on CPU: two ranks on gloo (``helpers.sglang_ranks``), each building real
``FusedMoE`` layers at TP = 2 or at TP = EP = 2 (SGLang's standard dispatch) and paging them. Per rank: the host rows
equal the unpaged layer's (SGLang's loaders shard them under TP and place them under EP), every step equals the
unpaged layer at the same layout (``torch.equal``), host- and device-planned steps interleaved; the host holds the
rank's share of the expert bytes; TP ranks decide the same residency at every step, EP ranks only about their own
experts. Also each rank's auto K from its share."""

from __future__ import annotations

import pytest
import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)
import torch

from helpers import sglang as H  # noqa: E402
from helpers import sglang_parallel as P  # noqa: E402
from helpers.sglang_ranks import run_ranks  # noqa: E402
from moepage.errors import ConfigError  # noqa: E402

PLANNER = {"MOEPAGE_DEVICE_PLANNER": "1"}  # the device planner on CPU too: its torch form, the torch store's gather


@pytest.fixture(scope="module", autouse=True)
def sglang_process():
    H.setup_sglang()


def _check_steps(records):
    for r in records:
        bad = [i for i, s in enumerate(r["steps"]) if not s["equal"]]
        assert not bad, f"rank {r['rank']}: steps {bad} differ from the unpaged layer"
        assert all(r["rows_equal"].values()), f"rank {r['rank']}: host rows differ: {r['rows_equal']}"
        hows = {s["how"] for s in r["steps"]}
        assert hows == {"host", "device", "captured"} and r["device_steps"] > 0 and r["host_steps"] > 0, r
        assert r["total_steps"] == len(P.STEPS)
        # the ranks' outputs sum to the layer's without TP or EP (bf16 rounding apart)
        assert max(s["whole_error"] for s in r["steps"]) < 0.02, [s["whole_error"] for s in r["steps"]]


def test_tensor_parallel_ranks_page_their_shards_and_agree():
    records = run_ranks(P.paged_steps, H.K, 1, world=2, ep=1, env=PLANNER)
    _check_steps(records)
    assert [r["tp_rank"] for r in records] == [0, 1]
    for r in records:
        assert r["local"] == P.EXPERTS and r["first"] == 0
        assert r["host_bytes"] == P.full_expert_bytes() // 2  # every expert, half of each
        assert r["agreed"], f"rank {r['rank']}: the TP ranks' residency diverged"
    first, second = records
    assert first["steps"] == [dict(s, equal=True) for s in second["steps"]]  # gathered by the caller too
    assert first["misses"] == second["misses"]


def test_expert_parallel_ranks_page_their_own_experts():
    records = run_ranks(P.paged_steps, H.K, 2, world=2, ep=2, env=PLANNER)
    _check_steps(records)
    local = P.EXPERTS // 2
    assert [(r["ep_rank"], r["first"], r["local"]) for r in records] == [(0, 0, local), (1, local, local)]
    for r in records:
        assert r["host_bytes"] == P.full_expert_bytes() // 2  # half the experts, whole
        for s in r["steps"]:
            assert len(s["expert_slot"]) == local and all(-1 <= e < local for e in s["slot_expert"])
    # each rank decided about its own experts only: routing the other rank's experts moved nothing here
    assert [s["slot_expert"] for s in records[0]["steps"]] != [s["slot_expert"] for s in records[1]["steps"]]


def test_expert_parallel_prefetch_predicts_each_ranks_own_experts():
    """Next-layer prefetch under EP: the router predicts checkpoint ids; each rank prefetches its own of them."""
    env = dict(PLANNER, MOEPAGE_SGLANG_PREFETCH="on")
    records = run_ranks(P.prefetch_steps, 2, 2, world=2, ep=2, env=env)  # K = top_k: little stays resident
    for r in records:
        for i, s in enumerate(r["steps"]):
            assert all(s["equal"]), f"rank {r['rank']} step {i}: outputs differ"
            assert set(s["wanted"]) <= set(s["resident"]), f"rank {r['rank']} step {i}: {s}"
        assert r["misses"] == 0 and r["prefetched"] > 0, r  # layer 1 never missed what was predicted
    assert any(s["wanted"] for r in records for s in r["steps"])


# -- auto K per rank -------------------------------------------------------------------------------------
def test_auto_k_sizes_each_rank_from_its_share():
    from moepage.integrations.auto import RankShare, choose_resident
    from moepage.planning.sizing import checkpoint_size

    ckpt = checkpoint_size(H.checkpoint("mixtral", torch.bfloat16))
    dense, slot = ckpt.dense_bytes, ckpt.slot_bytes
    gpu = dense // 2 + 3 * (slot // 2)  # budget: fraction 1.0, no KV reserve
    k, fig = choose_resident(ckpt, H.E, H.TOP_K, gpu, 1.0, 0.0, RankShare(tp_size=2, moe_tp_size=2))
    assert (k, fig["non_expert"], fig["per_slot"]) == (3, dense // 2, slot // 2)  # half of everything per rank
    with pytest.raises(ConfigError, match="top_k=2 are needed"):  # what one GPU holding it all could not fit
        choose_resident(ckpt, H.E, H.TOP_K, gpu, 1.0, 0.0)
    ep = RankShare(tp_size=2, moe_tp_size=1, ep_size=2)  # whole experts, half of them per rank
    assert choose_resident(ckpt, H.E // 2, H.TOP_K, 100 * (dense + slot), 1.0, 0.0, ep)[0] == H.E // 2
    assert choose_resident(ckpt, 1, H.TOP_K, dense // 2 + slot, 1.0, 0.0, ep)[0] == 1  # E / ep_size below top_k


def test_auto_k_on_an_expert_parallel_rank(monkeypatch, caplog):
    """``auto`` through make_for_layer at TP = EP = 2: K of the rank's 4 experts, from its share, logged."""
    import logging

    from moepage.integrations.sglang import method, sizing
    from moepage.planning.sizing import checkpoint_size

    path = H.checkpoint("mixtral", torch.bfloat16)
    ckpt = checkpoint_size(path)
    gpu = int((ckpt.dense_bytes / 2 + 3 * ckpt.slot_bytes) / 0.75 / 0.5) + 1  # fraction 0.5, 25 % KV -> K = 3
    real = sizing.auto_resident

    def on_a_gpu(num_experts, top_k, device, share):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": gpu})())
        monkeypatch.setattr(sizing, "_mem_fraction_static", lambda: 0.5)
        return real(num_experts, top_k, torch.device("cuda"), share)

    monkeypatch.setattr(method, "auto_resident", on_a_gpu)
    with H.server_args(**H.paged_args(k="auto", model_path=path), tp_size=2, ep_size=2):
        H.graph_config()
        with caplog.at_level(logging.INFO, logger="moepage.sglang"):
            layer = H.bare_layer()
    assert layer.quant_method.num_slots == 3 and layer.quant_method.num_experts == H.E // 2
    assert "chose K=3 of 4 experts" in caplog.text and "tp_size 2, moe_tp_size 1, ep_size 2" in caplog.text


@pytest.mark.parametrize("ep", [1, 2])
def test_each_rank_keeps_its_own_disk_layout_for_the_next_start(ep, tmp_path):
    """A disk tier under TP (each rank a shard of every expert: its rows of gate and up read in place, a run of each
    tensor in the file; its columns of down written to the spill folder) and EP (whole experts: read in place): each
    rank's layout is kept under its own place in the manifest, the next start of each rank reuses its own, and every
    host-planned step equals the unpaged layer's."""
    import json

    from safetensors.torch import save_file

    folder, spill = tmp_path / "ckpt", tmp_path / "rows"
    folder.mkdir()
    save_file(P.checkpoint(), str(folder / "model.safetensors"))
    first = run_ranks(P.disk_rows, H.K, ep, str(spill), str(folder), world=2, ep=ep)
    again = run_ranks(P.disk_rows, H.K, ep, str(spill), str(folder), world=2, ep=ep)
    for start, reused in ((first, False), (again, True)):
        for r in start:
            assert r["reused"] is reused and all(r["equal"]) and r["disk_reads"] > 0, r
    layouts = json.loads((spill / "manifest.json").read_text())["layouts"]
    places = sorted((x["source"]["rank"]["moe_tp_rank"], x["source"]["rank"]["ep_rank"]) for x in layouts)
    assert places == ([(0, 0), (1, 0)] if ep == 1 else [(0, 0), (0, 1)])  # one layout per rank
    weights = str((folder / "model.safetensors").resolve())
    for r in again:
        assert r["files"]["w13_weight"] == [weights]  # gate and up (whole, or the rank's rows of them) in place
        if ep == 2:
            assert r["files"]["w2_weight"] == [weights]
        else:  # the rank's columns of down: no run of the file, written to the spill folder
            assert len(r["files"]["w2_weight"]) == 1 and r["files"]["w2_weight"][0].startswith(str(spill.resolve()))
    assert [r["files"] for r in first] == [r["files"] for r in again]  # the same rows, reused
    if ep == 1:
        assert first[0]["files"]["w2_weight"] != first[1]["files"]["w2_weight"]  # each rank its own


@pytest.mark.parametrize("ep", [1, 2])
def test_each_rank_codes_its_share_once_and_a_restart_reuses_it(ep, tmp_path):
    """``--paged-experts-compress`` over a disk tier under TP and EP: each rank codes its own share (its shard of every
    expert, or its experts) into a file of its own, keeps it under its own place in the manifest, and the next start
    of each rank reuses its own; every host-planned step equals the unpaged layer's."""
    from safetensors.torch import save_file

    folder, spill = tmp_path / "ckpt", tmp_path / "rows"
    folder.mkdir()
    save_file(P.checkpoint(), str(folder / "model.safetensors"))
    first = run_ranks(P.disk_rows, H.K, ep, str(spill), str(folder), True, world=2, ep=ep)
    again = run_ranks(P.disk_rows, H.K, ep, str(spill), str(folder), True, world=2, ep=ep)
    for start, reused in ((first, False), (again, True)):
        for r in start:
            assert r["reused"] is reused and all(r["equal"]) and r["disk_reads"] > 0, r
            assert r["coded"] == ["w13_weight", "w2_weight"], r
    files = [{f for paths in r["files"].values() for f in paths} for r in again]  # the rank's coded rows, a tensor's
    assert all(len(f) == 2 and all(p.startswith(str(spill.resolve())) for p in f) for f in files), files
    assert not files[0] & files[1] and [r["files"] for r in first] == [r["files"] for r in again]  # its own, reused
