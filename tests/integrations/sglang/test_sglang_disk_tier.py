"""A disk tier under SGLang's paged layers (``--paged-experts-host-budget`` with ``--paged-experts-spill-dir``): real
Qwen3-MoE / Mixtral layers loaded through SGLang's own loaders into files in the spill folder (no host copy of every
row), laid out in place as the disk tier, H rows a layer in host memory; steps equal unpaged, the files go at
shutdown or when a load never finishes, and every setting that cannot work is refused at startup, naming it."""

from __future__ import annotations

import gc
import json
import os
import random
from pathlib import Path

import pytest
import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)
import torch

from helpers import sglang as H
from helpers.sglang import K, build_pair, forward
from moepage.errors import ConfigError
from moepage.planning.sizing import checkpoint_size

WAVES = {"one": (2, 3), "two": (4, 6), "many": (7, 8)}  # distinct experts per step, K = 3


@pytest.fixture(scope="module", autouse=True)
def sglang_process():
    H.setup_sglang()


def tier_args(spill, budget="4", **more):
    return dict(_moepage_paged_experts_host_budget=budget, _moepage_paged_experts_spill_dir=str(spill), **more)


@pytest.mark.parametrize("kind, dtype", [("qwen3_moe", torch.bfloat16), ("mixtral", torch.float32)])
def test_rows_load_into_the_spill_folder_and_steps_equal_unpaged(kind, dtype, tmp_path):
    from moepage.backends.tiered import TieredStore
    from moepage.integrations import session

    ref, paged = build_pair(kind, dtype, **tier_args(tmp_path))  # no checkpoint folder known: nothing is kept
    files = sorted(p.name for p in tmp_path.glob("*.moepage"))
    assert len(files) == 2 * len(H.moe_layers(ref)) and all(f.startswith("staged-") for f in files)  # a tensor's
    assert_rows_and_steps_equal(ref, paged, dtype)
    held = {lt.store for lt in session._LIFETIMES.values() if isinstance(lt.store, TieredStore)}
    del paged
    gc.collect()
    assert all(s._closed for s in held) and not list(tmp_path.glob("*.moepage"))  # its files went with the store


@pytest.mark.parametrize("kind, dtype, stored", [("qwen3_moe", torch.bfloat16, torch.bfloat16),
                                                 ("mixtral", torch.float32, torch.float32),
                                                 ("qwen3_moe", torch.float32, torch.bfloat16)])
def test_rows_are_read_where_the_checkpoint_holds_them(kind, dtype, stored, tmp_path):
    """With the checkpoint's folder known, a row whose bytes SGLang's loader takes unchanged is read from the
    checkpoint's file (a fused gate-and-up row from its two tensors' places), no copy written; where the loader casts
    (a checkpoint stored in another dtype) the rows are staged in the spill folder as before. Equal to unpaged."""
    folder = H.checkpoint(kind, stored)
    ref, paged = build_pair(kind, dtype, stored=stored, **tier_args(tmp_path), model_path=folder)
    files = {str(p.resolve()) for p in Path(folder).glob("*.safetensors")}
    staged = {str(p.resolve()) for p in tmp_path.glob("*.moepage")}
    if dtype == stored:
        assert not staged and files_of(paged) == files
        for p in H.moe_layers(paged):
            rows = p.quant_method.store.disk.rows
            assert {len(row) for (_, n), r in rows.items() for row in r if n == "w13_weight"} == {2}  # gate, up
            assert {len(row) for (_, n), r in rows.items() for row in r if n == "w2_weight"} == {1}
    else:
        assert len(staged) == 2 * len(H.moe_layers(ref)) and files_of(paged) == staged
    assert_rows_and_steps_equal(ref, paged, dtype)
    del paged  # its layers' names free for the next test's (a kept layout names its layers)
    gc.collect()


def assert_rows_and_steps_equal(ref, paged, dtype) -> None:
    """Every row of every paged layer reads back from the disk tier as SGLang's loader wrote it unpaged, and steps
    of one, two and many waves equal unpaged, some rows read from disk."""
    from moepage.backends.tiered import TieredStore

    rng = random.Random(5)
    for r, p in zip(H.moe_layers(ref), H.moe_layers(paged)):
        method = p.quant_method
        assert isinstance(method.store, TieredStore) and method.store.held_rows(method.layer_key) == 4
        assert method.pager.device_state is None  # planned on the host
        for n in method.names:
            for e in range(H.E):
                assert torch.equal(method.store.read_row(method.layer_key, n, e), getattr(r, n).data[e]), (n, e)
        for lo, hi in WAVES.values():
            for _ in range(3):
                distinct = rng.randint(lo, hi)
                ids = H.routing(rng, rng.randint(max(1, (distinct + 1) // 2), 9), distinct)
                x = torch.randn(ids.shape[0], H.HIDDEN, dtype=dtype)
                assert torch.equal(forward(p, x, H.topk_output(ids, 1)), forward(r, x, H.topk_output(ids, 1)))
        tier = method.store.tier_stats(method.layer_key)
        assert tier.host_misses > 0 and tier.disk_bytes > 0  # the host tier held 4 of 8: some rows came from disk


def test_a_restart_reuses_the_rows_an_earlier_start_laid_out(tmp_path, monkeypatch):
    """With the checkpoint's folder known, a layer's rows stay on disk after shutdown, named in the folder's manifest;
    the next start of the same checkpoint writes no row and pages them exactly; a changed checkpoint is laid out
    anew and the old files go."""
    import shutil

    from moepage.integrations import rows

    folder = tmp_path / "ckpt"
    shutil.copytree(H.checkpoint("qwen3_moe", torch.bfloat16), folder)  # its files' identity names the source
    spill = tmp_path / "rows"
    ref, first = build_pair("qwen3_moe", torch.bfloat16, **tier_args(spill), model_path=str(folder))
    # every row read in place from the checkpoint's files: no copy written, the manifest names them
    assert (spill / "manifest.json").exists() and not list(spill.glob("*.moepage"))
    assert files_of(first) == {str(p.resolve()) for p in folder.glob("*.safetensors")}
    kept = (spill / "manifest.json").read_text()
    del first
    gc.collect()
    assert (spill / "manifest.json").read_text() == kept  # shut down: the layout stays for the next start

    def refuse(*args):
        raise AssertionError("a row was staged again")

    with monkeypatch.context() as m:
        m.setattr(rows, "staged_rows", refuse)
        with H.server_args(**H.paged_args(**tier_args(spill), model_path=str(folder))):
            again = H.build_model("qwen3_moe", torch.bfloat16)
    assert_rows_and_steps_equal(ref, again, torch.bfloat16)
    del again
    gc.collect()
    weights = next(folder.glob("*.safetensors"))
    shutil.copy(weights, tmp_path / "w")
    os.replace(tmp_path / "w", weights)  # the same bytes in a new file: the source changed
    _, third = build_pair("qwen3_moe", torch.bfloat16, **tier_args(spill), model_path=str(folder))
    assert (spill / "manifest.json").read_text() != kept  # laid out anew, from the new file
    assert files_of(third) == {str(weights.resolve())}
    assert_rows_and_steps_equal(ref, third, torch.bfloat16)


def write_trace(path, num_experts=H.E, hot=((6, 7, 5, 1, 0), (2, 0, 4, 3, 1))) -> str:
    """A routing trace (``moepage record``'s format) whose MoE layer l routes hot[l][i] in 10 - 2i of 10 steps."""
    import numpy as np

    from moepage.planning.traces import save_simple

    ids = np.full((10, len(hot), len(hot[0])), -1, dtype=np.int32)
    for layer, experts in enumerate(hot):
        for i, e in enumerate(experts):
            ids[: 10 - 2 * i, layer, i] = e
    save_simple(path, ids, num_experts, H.TOP_K)
    return str(path)


def test_the_host_tier_starts_with_the_experts_a_trace_routes_to_most(tmp_path):
    """``--paged-experts-host-warm TRACE``: each MoE layer's host tier holds the trace's H most routed experts of
    that layer at startup (read then, counted as no step's misses); steps equal unpaged."""
    gc.collect()  # earlier tests' models gone: this model's MoE layers count from 0, as in a server's process
    hot = ((6, 7, 5, 1, 0), (2, 0, 4, 3, 1))
    trace = write_trace(tmp_path / "trace.npz", hot=hot)
    ref, paged = build_pair("qwen3_moe", torch.bfloat16, **tier_args(tmp_path / "rows"),
                            _moepage_paged_experts_host_warm=trace)
    for p, experts in zip(H.moe_layers(paged), hot):
        method = p.quant_method
        tier = method.store._layers[method.layer_key].residency
        assert {e for e in range(H.E) if tier.expert_slot[e] >= 0} == set(experts[:4])  # H = 4
        assert method.store.tier_stats(method.layer_key).host_misses == 0
    assert_rows_and_steps_equal(ref, paged, torch.bfloat16)
    del paged
    gc.collect()


def files_of(model) -> set[str]:
    """The files the paged layers' rows are read from."""
    return {x.path for p in H.moe_layers(model) for rows in p.quant_method.store.disk.rows.values()
            for row in rows for x in row}


def test_a_byte_budget_gives_the_rows_it_buys(tmp_path):
    """``--paged-experts-host-budget 5 rows' worth of bytes``: H = the bytes over one expert in every MoE layer."""
    path = H.checkpoint("qwen3_moe", torch.bfloat16)
    per_slot = checkpoint_size(path).slot_bytes
    _, paged = build_pair("qwen3_moe", torch.bfloat16, **tier_args(tmp_path, f"{5 * per_slot + 7}B"), model_path=path)
    assert {p.quant_method.store.held_rows(p.quant_method.layer_key) for p in H.moe_layers(paged)} == {5}


@pytest.mark.parametrize("served, stored, h", [(torch.float32, torch.bfloat16, 3), (torch.bfloat16, torch.float32, 6)])
def test_a_byte_budget_counts_the_rows_at_the_dtype_they_are_served_in(served, stored, h, tmp_path):
    """A checkpoint stored in one dtype and served in another: a byte budget buys rows as the layers hold them (the
    served dtype), not as the checkpoint stores them: H rows in every MoE layer fit it, H + 1 do not."""
    path = H.checkpoint("qwen3_moe", stored)
    layers = checkpoint_size(path).num_layers
    row = 3 * H.INTER * H.HIDDEN * served.itemsize  # gate, up and down of one expert, served
    budget = (h + 1) * row * layers - 1
    with H.server_args(**H.paged_args(**tier_args(tmp_path, f"{budget}B"), model_path=path)):
        paged = H.build_model("qwen3_moe", served, stored=stored)
    for p in H.moe_layers(paged):
        method = p.quant_method
        held = sum(getattr(p, n)[0].nbytes for n in method.names)  # one row as the layer holds it
        assert held == row and method.store.held_rows(method.layer_key) == h
        assert h * held * layers <= budget < (h + 1) * held * layers
    del paged
    gc.collect()


@pytest.mark.parametrize("budget", ["8", "9", "every row's bytes"])
def test_a_budget_that_holds_every_expert_makes_no_disk_tier_and_says_so_once(budget, tmp_path, caplog):
    """H >= E, as rows or as bytes: the rows stay in host memory, no disk tier is made (nothing in the spill folder),
    and one warning names the option and says so; steps equal unpaged."""
    from moepage.backends.tiered import TieredStore

    path = H.checkpoint("qwen3_moe", torch.bfloat16)
    if budget == "every row's bytes":
        budget = f"{checkpoint_size(path).experts_total_bytes}B"
    with caplog.at_level("WARNING", logger="moepage"):
        ref, paged = build_pair("qwen3_moe", torch.bfloat16, **tier_args(tmp_path / "rows", budget), model_path=path)
    said = [r.getMessage() for r in caplog.records if "no disk tier is needed" in r.getMessage()]
    assert said == [f"moepage: --paged-experts-host-budget {budget} holds every expert of each MoE layer (E={H.E}"
                    + said[0].split(f"(E={H.E}", 1)[1]]
    for p in H.moe_layers(paged):
        assert p.quant_method.rows.tier is None and not isinstance(p.quant_method.store, TieredStore)
    assert not (tmp_path / "rows").exists()
    rng = random.Random(3)
    for r, p in zip(H.moe_layers(ref), H.moe_layers(paged)):
        ids = H.routing(rng, 9, 7)
        x = torch.randn(ids.shape[0], H.HIDDEN, dtype=torch.bfloat16)
        assert torch.equal(forward(p, x, H.topk_output(ids, 1)), forward(r, x, H.topk_output(ids, 1)))
    del paged
    gc.collect()


def test_an_unfinished_load_leaves_no_files(tmp_path):
    """A layer built (its loaders' files made) and never post-loaded, as when a load fails: its files go with it."""
    with H.server_args(**H.paged_args(**tier_args(tmp_path))):
        H.graph_config()
        layer = H.bare_layer()
    assert len(list(tmp_path.glob("*.moepage"))) == 2
    del layer
    gc.collect()
    assert not list(tmp_path.glob("*.moepage"))


def test_a_layer_still_loading_keeps_its_store_when_the_last_other_layer_goes(tmp_path):
    """A layer whose rows are staged until post-load took the process's store at construction: the last finished
    layer going meanwhile (collected) does not close it under the loading one."""
    from helpers import sglang_parallel as P

    gc.collect()  # earlier tests' layers gone: the two below are the store's only ones
    ckpt = P.checkpoint()
    with H.server_args(**H.paged_args(**tier_args(tmp_path))):
        H.graph_config()
        done = H.bare_layer()
        H.load_experts(done, ckpt)
        done.quant_method.process_weights_after_loading(done)
        loading = H.bare_layer()
        H.load_experts(loading, ckpt)
    del done
    gc.collect()  # the finished layer's lease returned: the store would close, were the loading layer not joining
    with H.server_args(**H.paged_args(**tier_args(tmp_path))):
        loading.quant_method.process_weights_after_loading(loading)
        assert not loading.quant_method.store._closed


@pytest.mark.parametrize("more, says", [
    (dict(_moepage_paged_experts_host_budget="4"), "keeps experts on disk: pass --paged-experts-spill-dir DIR"),
    (dict(_moepage_paged_experts_spill_dir="/tmp/x"), "--paged-experts-spill-dir is for --paged-experts-host-budget"),
    (dict(_moepage_paged_experts_host_budget="lots", _moepage_paged_experts_spill_dir="/tmp/x"),
     "--paged-experts-host-budget 'lots': not a number of host rows or a byte size"),
    (dict(_moepage_paged_experts_host_budget="2", _moepage_paged_experts_spill_dir="/tmp/x"),
     f"--paged-experts-host-budget 2 holds 2 expert rows in each MoE layer, fewer than its K={K} slots"),
    (dict(_moepage_paged_experts_host_warm="t.npz"),
     "--paged-experts-host-warm t.npz is for --paged-experts-host-budget"),
    (dict(_moepage_paged_experts_host_budget="4", _moepage_paged_experts_spill_dir="/tmp/x",
          _moepage_paged_experts_host_warm="/nonexistent/t.npz"), "--paged-experts-host-warm '/nonexistent/t.npz'"),
    (dict(_moepage_paged_experts_host_budget="4", _moepage_paged_experts_spill_dir="/tmp/x",
          _moepage_paged_experts_host_warm="E16"), "its routing is over E=16 experts, not 8"),
])
def test_what_cannot_work_is_refused_at_startup_naming_it(more, says, tmp_path):
    if more.get("_moepage_paged_experts_host_warm") == "E16":  # a trace of a model of 16 experts
        more = {**more, "_moepage_paged_experts_host_warm": write_trace(tmp_path / "t.npz", num_experts=16)}
    with H.server_args(**H.paged_args(**more)):
        H.graph_config()
        with pytest.raises(ConfigError) as err:
            H.bare_layer()
    assert says in str(err.value)


def test_a_spill_folder_that_cannot_be_one_is_refused_at_startup_naming_how_it_was_given(tmp_path, monkeypatch):
    """A file (or a path under one) is no spill folder: refused when the first layer is built, with the launch's other
    problems, naming the flag or the variable it came by (as ``wrap`` checks it), not a raw error at load."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    with H.server_args(**H.paged_args(**tier_args(afile), _moepage_paged_experts_policy="fifo")):
        H.graph_config()
        with pytest.raises(ConfigError) as err:
            H.bare_layer()
    text = str(err.value)
    assert f"--paged-experts-spill-dir '{afile}': {afile} is a file, not a folder" in text
    assert "--paged-experts-policy" in text  # said with the other problems, at once
    monkeypatch.setenv("MOEPAGE_SPILL_DIR", str(afile / "rows"))
    with H.server_args(**H.paged_args(_moepage_paged_experts_host_budget="4")):
        H.graph_config()
        with pytest.raises(ConfigError, match=f"MOEPAGE_SPILL_DIR '{afile}/rows': {afile} is a file, not a folder"):
            H.bare_layer()
    assert not list(tmp_path.glob("*.moepage"))


def test_full_decode_graphs_are_refused_with_what_to_do(tmp_path):
    with H.server_args(**H.paged_args(**tier_args(tmp_path))):
        H.graph_config(decode="full", bs=[1, 2])
        with pytest.raises(ConfigError) as err:
            H.bare_layer()
    text = str(err.value)
    assert "a full decode CUDA graph cannot replay" in text and "--cuda-graph-backend-decode disabled" in text
    assert "install moepage[cuda]" not in text  # the disk tier's reason, not the store's


def test_breakable_decode_graphs_are_refused_with_a_disk_tier_too(tmp_path):
    """SGLang 0.5.23's breakable decode graph cannot hold the logits output a model returns (the engine failed to
    start on a GPU): refused at startup, saying what serves a disk tier; eager decode serves it."""
    with H.server_args(**H.paged_args(**tier_args(tmp_path))):
        H.graph_config(decode="breakable")
        with pytest.raises(ConfigError, match=r"decode CUDA graph backend 'breakable' .*use disabled \(with a disk"):
            H.bare_layer()
        H.graph_config(decode="disabled")
        assert H.bare_layer().quant_method.rows.tier is not None
    with H.server_args(**H.paged_args()):
        H.graph_config(decode="breakable")
        with pytest.raises(ConfigError, match="decode CUDA graph backend 'breakable' is not supported: use full or"):
            H.bare_layer()


def test_coded_rows_on_disk_page_exactly_and_a_restart_reuses_them_uncoded_again(tmp_path, monkeypatch, caplog):
    """``--paged-experts-compress`` with a disk tier: each layer's rows are coded from the rows SGLang's loader wrote
    (read back where the checkpoint holds them: nothing staged), kept coded on disk and in the host tier (fewer bytes
    read), decoded into the slots: steps equal unpaged. A restart of the same checkpoint stages and codes nothing:
    the coded rows and their codes come from the manifest. A start without compress does not take the coded layout."""
    import shutil

    from moepage import compress, lifetime
    from moepage.integrations import rows

    folder = tmp_path / "ckpt"
    shutil.copytree(H.checkpoint("qwen3_moe", torch.bfloat16), folder)
    spill = tmp_path / "rows"
    args = tier_args(spill, _moepage_paged_experts_compress=True)
    with caplog.at_level("INFO", logger="moepage"):
        ref, first = build_pair("qwen3_moe", torch.bfloat16, **args, model_path=str(folder))
    layers = len(H.moe_layers(ref))
    assert caplog.text.count(f"{2 * H.E} of {2 * H.E} expert rows lie in place in the checkpoint") == layers
    assert not list(spill.glob("staged-*")) and len(list(spill.glob("rows-*"))) == 2 * layers  # coded, a tensor's
    for p in H.moe_layers(first):
        held = p.quant_method.store.layer_bytes(p.quant_method.layer_key)
        assert set(held.coded) == set(p.quant_method.names)  # every tensor coded (on disk and in host memory)
        assert held.held < 4 * sum(getattr(p, n)[0].nbytes for n in p.quant_method.names)  # H = 4 coded rows
    del p  # (its layer's name free for the restart's)
    assert_rows_and_steps_equal(ref, first, torch.bfloat16)
    read = sum(p.quant_method.store.tier_stats(p.quant_method.layer_key).disk_bytes for p in H.moe_layers(first))
    kept = (spill / "manifest.json").read_text()
    del first
    gc.collect()

    def refuse(*args, **kwargs):
        raise AssertionError("a row was staged or coded again")

    with monkeypatch.context() as m:
        m.setattr(rows, "staged_rows", refuse)
        m.setattr(compress, "encode_rows", refuse)
        m.setattr(lifetime, "plan_code", refuse)
        with H.server_args(**H.paged_args(**args, model_path=str(folder))):
            again = H.build_model("qwen3_moe", torch.bfloat16)
    assert_rows_and_steps_equal(ref, again, torch.bfloat16)
    assert sum(p.quant_method.store.tier_stats(p.quant_method.layer_key).disk_bytes
               for p in H.moe_layers(again)) == read  # the same steps read the same coded bytes
    assert (spill / "manifest.json").read_text() == kept
    del again
    gc.collect()
    with H.server_args(**H.paged_args(**tier_args(spill), model_path=str(folder))):  # raw rows: not the coded layout
        raw = H.build_model("qwen3_moe", torch.bfloat16)
    assert_rows_and_steps_equal(ref, raw, torch.bfloat16)
    assert all(not p.quant_method.store.layer_bytes(p.quant_method.layer_key).coded for p in H.moe_layers(raw))
    del raw
    gc.collect()
    data = json.loads((spill / "manifest.json").read_text())  # a coded layout lacking a code (damage, another version)
    del next(x for x in data["layouts"] if x["source"].get("coded"))["codes"]
    (spill / "manifest.json").write_text(json.dumps(data))
    coded = []
    with monkeypatch.context() as m:
        m.setattr(compress, "encode_rows", lambda *a, enc=compress.encode_rows: coded.append(1) or enc(*a))
        anew = build_pair("qwen3_moe", torch.bfloat16, **args, model_path=str(folder))[1]
    assert coded  # never served: coded anew
    assert_rows_and_steps_equal(ref, anew, torch.bfloat16)
