"""``from_pretrained`` with a disk tier (``host_budget=``, ``spill_dir=``): every architecture's checkpoint, rows read
in place where the checkpoint's bytes are the rows and spilled where the load transforms them (a cast, a fused
gate/up), equal to the unpaged model; the layout kept and reused by the next load of the same checkpoint; a checkpoint
changed after load refused at the read and laid out again by the next load; loads of several checkpoints sharing a
folder leave no file that no manifest names."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil

import pytest
import torch

import moepage
from helpers.hf import ARCHS, DTYPES, FORMATS, assert_same, configs, make_checkpoints, reference, run
from moepage.backends import disk
from moepage.errors import PageInError
from moepage.integrations import transformers as mhf

pytestmark = pytest.mark.usefixtures("one_thread")
FILES = 4  # spill files a load writes where it must write every row: one per expert tensor of each MoE layer
CASES = [(a, f) for a in ARCHS for f in FORMATS if not (a == "gpt_oss" and f == "per_expert")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoints(tmp_path_factory)


def _load(path: str, k: int, folder, dtype=torch.float32, h: int | None = None, **more):
    impl = "grouped_mm" if dtype == torch.float32 else "eager"
    return mhf.from_pretrained(path, resident=k, device="cpu", dtype=dtype, experts_implementation=impl,
                               **{"progress": False, **more}, host_budget=h or k, spill_dir=folder)


def _spilled(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".moepage"))


def _named(folder) -> list[str]:
    data = json.loads((folder / "manifest.json").read_text())
    return sorted(os.path.basename(f[0]) for layout in data["layouts"] for f in layout["files"]
                  if f[0].endswith(".moepage"))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch, fmt", CASES)
def test_from_pretrained_with_rows_on_disk_equals_unpaged(checkpoint, tmp_path, arch, fmt, dtype):
    path, k = checkpoint(arch, fmt)
    impl = "grouped_mm" if dtype == "fp32" else "eager"
    ref = run(reference(path, DTYPES[dtype], impl))
    model = _load(path, k, tmp_path, DTYPES[dtype], h=k + 1)
    assert_same(ref, run(model))
    total = moepage.stats(model).total
    assert total.host_misses > 0 and total.disk_bytes > 0  # rows were read from disk
    moepage.unwrap(model)
    assert _spilled(tmp_path) == _named(tmp_path)  # the rows it spilled stay for the next load, named


def test_a_second_load_reuses_the_rows_and_writes_none(checkpoint, tmp_path, monkeypatch, caplog):
    path, k = checkpoint("qwen3_moe", "per_expert")
    ref = run(reference(path, torch.bfloat16, "eager"))
    first = _load(path, k, tmp_path, torch.bfloat16)  # cast from fp32: every row spilled
    spilled = _spilled(tmp_path)
    assert len(spilled) == FILES  # a file a tensor
    moepage.unwrap(first)

    def refuse(*args):
        raise AssertionError("a row was written again")

    monkeypatch.setattr(disk.SpillFile, "write", refuse)
    with caplog.at_level("INFO", logger="moepage"):
        second = _load(path, k, tmp_path, torch.bfloat16)
    assert "reused" in caplog.text
    assert_same(ref, run(second))
    assert _spilled(tmp_path) == spilled


def test_a_checkpoint_changed_after_load_is_refused_then_laid_out_again(checkpoint, tmp_path):
    source, k = checkpoint("mixtral", "per_expert")
    path = tmp_path / "ckpt"
    shutil.copytree(source, path)
    folder = tmp_path / "rows"
    model = _load(str(path), k, folder, torch.bfloat16)
    ref = run(reference(str(path), torch.bfloat16, "eager"))
    old = _spilled(folder)
    weights = path / "model.safetensors"
    shutil.copy(weights, tmp_path / "w")
    os.replace(tmp_path / "w", weights)  # the same bytes in a new file: rows laid out against the old one are stale
    again = _load(str(path), k, folder, torch.bfloat16)  # the old layout's files changed: laid out anew, old dropped
    assert len(_named(folder)) == FILES and not set(_named(folder)) & set(old)
    assert _spilled(folder) == sorted(old + _named(folder))  # the first model still reads its file: it stays
    assert_same(ref, run(again))
    del model
    gc.collect()
    assert _spilled(folder) == _named(folder)  # its last user gone, the old layout's files went with it
    moepage.unwrap(again)
    _load(str(path), k, folder, torch.bfloat16)  # reused
    assert _spilled(folder) == _named(folder)


def test_a_file_read_in_place_changed_after_load_is_refused_naming_it(checkpoint, tmp_path):
    source, k = checkpoint("qwen3_moe", "per_expert")
    path = tmp_path / "ckpt"
    shutil.copytree(source, path)
    model = _load(str(path), k, tmp_path / "rows")  # fp32 per-expert rows: read in place from the checkpoint
    assert _spilled(tmp_path / "rows") == []
    weights = path / "model.safetensors"
    shutil.copy(weights, tmp_path / "w")
    os.replace(tmp_path / "w", weights)
    ids = torch.arange(40).view(2, 20) % 96
    with pytest.raises(PageInError, match=r"model\.safetensors: the file changed after its rows were laid out"):
        with torch.no_grad():
            model(ids)


def test_loads_of_several_checkpoints_share_a_folder_without_orphans(checkpoint, tmp_path):
    q, kq = checkpoint("qwen3_moe", "per_expert")
    m, km = checkpoint("mixtral", "per_expert")
    a = _load(q, kq, tmp_path, torch.bfloat16)
    b = _load(m, km, tmp_path, torch.bfloat16)
    c = _load(q, kq, tmp_path, torch.float16)
    assert len(_spilled(tmp_path)) == 3 * FILES and _spilled(tmp_path) == _named(tmp_path)
    again = _load(q, kq, tmp_path, torch.bfloat16)  # reused: nothing new
    assert len(_spilled(tmp_path)) == 3 * FILES
    assert_same(run(reference(q, torch.bfloat16, "eager")), run(again))
    for model in (a, b, c, again):
        moepage.unwrap(model)
    assert len(_spilled(tmp_path)) == 3 * FILES and _spilled(tmp_path) == _named(tmp_path)


def test_two_loads_of_one_checkpoint_at_once_keep_one_layout(checkpoint, tmp_path, monkeypatch):
    """Both find no layout and write their rows; the second to keep finds the first's and its own file goes with it."""
    from moepage.backends import manifest

    path, k = checkpoint("qwen3_moe", "per_expert")
    found = manifest.find
    monkeypatch.setattr(manifest, "find", lambda *args: None)  # neither sees the other's layout yet
    a = _load(path, k, tmp_path, torch.bfloat16)
    b = _load(path, k, tmp_path, torch.bfloat16)
    monkeypatch.setattr(manifest, "find", found)
    assert len(_spilled(tmp_path)) == 2 * FILES and len(_named(tmp_path)) == FILES
    ref = run(reference(path, torch.bfloat16, "eager"))
    assert_same(ref, run(b))
    moepage.unwrap(b)
    assert _spilled(tmp_path) == _named(tmp_path)
    moepage.unwrap(a)


def test_the_host_budget_variable_counts_in_the_host_memory_check(checkpoint, tmp_path, monkeypatch):
    from moepage.nn.find import find_experts, row_bytes
    from moepage.planning import host

    path, k = checkpoint("qwen3_moe", "per_expert")
    model = reference(path, torch.float32, "grouped_mm")
    e = configs()["qwen3_moe"][0].num_experts
    every_row = sum(row_bytes(m) for _, m in find_experts(model))
    rest = sum(t.nbytes for t in (*model.parameters(), *model.buffers())) - every_row
    fits = rest + 2 * every_row * k // e + 4096  # H = K rows and the K slots, not all E rows
    monkeypatch.setattr(host, "host_memory_available", lambda: host.AvailableMemory(fits, "a test figure"))
    with pytest.raises(moepage.ConfigError, match="a paged load needs"):
        mhf.from_pretrained(path, resident=k, device="cpu", progress=False)
    monkeypatch.setenv("MOEPAGE_HOST_BUDGET", str(k))
    loaded = mhf.from_pretrained(path, resident=k, device="cpu", progress=False, spill_dir=tmp_path)
    layer = next(moepage.paged_layers(loaded))
    assert layer.store.held_rows(layer.name) == k


def test_a_byte_budget_counts_the_rows_at_the_dtype_they_are_loaded_in(checkpoint, tmp_path):
    """A float32 checkpoint loaded in bfloat16: a byte budget buys rows as the model holds them (bf16), H rows in
    every MoE layer fit it and H + 1 do not (the checkpoint's float32 bytes would buy about half as many)."""
    from moepage.nn.find import find_experts, row_bytes

    path, k = checkpoint("qwen3_moe", "per_expert")
    ref = reference(path, torch.bfloat16, "eager")
    rows = [row_bytes(m, 1) for _, m in find_experts(ref)]  # one row of each MoE layer, as loaded
    h = k + 2
    budget = (h + 1) * sum(rows) - 1
    model = _load(path, k, tmp_path, torch.bfloat16, h=f"{budget}B")
    layers = list(moepage.paged_layers(model))
    assert len(layers) == len(rows) and {layer.store.held_rows(layer.name) for layer in layers} == {h}
    assert h * sum(rows) <= budget < (h + 1) * sum(rows)
    assert budget // (2 * sum(rows)) < h  # what the checkpoint's own (float32) bytes would have bought
    moepage.unwrap(model)


def test_a_budget_that_holds_every_expert_loads_with_no_disk_tier_and_says_so(checkpoint, tmp_path):
    """As ``wrap``: H >= E (rows or bytes) keeps every row in host memory, no disk tier, the spill folder unused."""
    from moepage.backends.tiered import TieredStore

    path, k = checkpoint("qwen3_moe", "per_expert")
    e = configs()["qwen3_moe"][0].num_experts
    for budget in (e, "1GiB"):
        with pytest.warns(UserWarning, match=rf"host_budget={budget!r} holds every expert of each MoE layer \(E={e}"):
            model = _load(path, k, tmp_path / "rows", h=budget)
        assert not isinstance(next(moepage.paged_layers(model)).store, TieredStore)
        assert not (tmp_path / "rows").exists()
        moepage.unwrap(model)


def test_an_unreadable_host_budget_is_named_before_the_checkpoint_is_read(checkpoint, tmp_path, monkeypatch):
    from moepage.integrations.transformers import checkpoint as ckpt

    path, k = checkpoint("qwen3_moe", "per_expert")
    monkeypatch.setattr(ckpt, "checkpoint_files", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("read")))
    with pytest.raises(moepage.ConfigError, match=r"host_budget='lots': .*expected host rows per layer"):
        mhf.from_pretrained(path, resident=k, device="cpu", progress=False, host_budget="lots", spill_dir=tmp_path)
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_named_by_a_relative_path_or_a_link_is_one_source(checkpoint, tmp_path, monkeypatch):
    """The source names the checkpoint's files by their real paths: a load from another directory neither takes a
    live model's layout for stale nor writes a second copy for another spelling of the same checkpoint."""
    source, k = checkpoint("mixtral", "per_expert")
    shutil.copytree(source, tmp_path / "ckpt")
    (tmp_path / "link").symlink_to(tmp_path / "ckpt")
    other, ko = checkpoint("qwen3_moe", "per_expert")
    folder = tmp_path / "rows"
    monkeypatch.chdir(tmp_path)
    a = _load("ckpt", k, folder, torch.bfloat16)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    b = _load(other, ko, folder, torch.bfloat16)  # saving its layout must not take a's for stale
    assert_same(run(reference(str(tmp_path / "ckpt"), torch.bfloat16, "eager")), run(a))
    again = _load(str(tmp_path / "link"), k, folder, torch.bfloat16)  # another spelling of a's checkpoint: reused
    assert len(_spilled(folder)) == 2 * FILES and _spilled(folder) == _named(folder)
    for model in (a, b, again):
        moepage.unwrap(model)


def test_a_checkpoint_rewritten_with_its_size_and_mtime_kept_is_not_reused(checkpoint, tmp_path):
    source, k = checkpoint("mixtral", "per_expert")
    path = tmp_path / "ckpt"
    shutil.copytree(source, path)
    moepage.unwrap(_load(str(path), k, tmp_path / "rows", torch.bfloat16))
    from moepage.planning.sizing import read_header

    weights = path / "model.safetensors"
    st = os.stat(weights)
    at = next(t.offset for t in read_header(str(weights)) if ".experts.0." in t.name)
    data = bytearray(weights.read_bytes())
    data[at : at + 64] = data[at : at + 64][::-1]  # an expert's bytes, changed in place
    with open(weights, "r+b") as f:
        f.write(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(weights).st_size == st.st_size and os.stat(weights).st_mtime_ns == st.st_mtime_ns
    again = _load(str(path), k, tmp_path / "rows", torch.bfloat16)
    assert_same(run(reference(str(path), torch.bfloat16, "eager")), run(again))


@pytest.mark.parametrize("text", ['{"version": 2, "layouts": null}', '{"version": 2, "layouts": 5}',
                                  '{"version": 2, "layouts": [{"version": 1, "files": 5}]}',
                                  '{"version": 2, "layouts": [{"files": [7]}]}', '{"version": 1, "files": null}',
                                  "[1, 2]", "not json", '{"version": 3}'])
def test_a_manifest_of_another_shape_is_no_layout(checkpoint, tmp_path, text):
    path, k = checkpoint("qwen3_moe", "per_expert")
    (tmp_path / "manifest.json").write_text(text)
    with pytest.warns(UserWarning, match=rf"spill folder {tmp_path}: its manifest {tmp_path}/manifest.json could not "
                                         "be read .* not reused"):
        model = _load(path, k, tmp_path, torch.bfloat16)
    assert_same(run(reference(path, torch.bfloat16, "eager")), run(model))
    assert _spilled(tmp_path) == _named(tmp_path)


def _damage_folder(folder, damage: str, coded: bool) -> str:
    """Damage ``folder`` as a user or a disk might: a byte of a rows file of the (coded or raw) layout flipped with its
    modification time put back, the file cut short or removed, or the manifest garbled. Returns the file damaged."""
    layouts = json.loads((folder / "manifest.json").read_text())["layouts"]
    path = next(f[0] for x in layouts if bool(x["source"].get("coded")) == coded for f in x["files"]
                if f[0].endswith(".moepage"))
    st = os.stat(path)
    if damage == "a byte flipped, mtime kept":
        with open(path, "r+b") as f:
            f.seek(10)
            byte = f.read(1)
            f.seek(10)
            f.write(bytes([byte[0] ^ 0xFF]))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif damage == "rows file truncated":
        os.truncate(path, st.st_size - 4096)
    elif damage == "rows file removed":
        os.remove(path)
    else:
        (folder / "manifest.json").write_text('{"version": 2, "layouts": [')
        return str(folder / "manifest.json")
    return path


@pytest.mark.parametrize("damage, why", [("a byte flipped, mtime kept", r"changed after its rows were laid out \(its "
                                                                       r"change time \(ctime_ns\)"),
                                         ("rows file truncated", r"shorter than its manifest says"),
                                         ("rows file removed", r"is missing"),
                                         ("manifest garbled", r"could not be read \(it is not JSON")])
@pytest.mark.parametrize("coded", [False, True])
def test_a_damaged_spill_folder_is_laid_out_again_and_a_warning_says_why_once(checkpoint, tmp_path, damage, why,
                                                                              coded):
    """A kept layout the next load cannot reuse for damage to the folder is laid out again, exactly, and one warning
    (progress off: the only sign) names the folder, the file and what is wrong; the load after reuses the new layout
    and says nothing."""
    import warnings

    path, k = checkpoint("qwen3_moe", "per_expert")  # fp32 loaded as bf16: the raw rows are spilled too
    ref = run(reference(path, torch.bfloat16, "eager"))
    moepage.unwrap(_load(path, k, tmp_path, torch.bfloat16, compress=coded))
    damaged = _damage_folder(tmp_path, damage, coded)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _load(path, k, tmp_path, torch.bfloat16, compress=coded)
    said = [str(w.message) for w in caught if "not reused" in str(w.message)]
    assert len(said) == 1, said
    assert re.search(rf"spill folder {tmp_path}: .*{re.escape(damaged)}.*{why}", said[0]), said[0]
    if damage != "manifest garbled":
        assert ("coded expert rows" in said[0]) == coded and "laid out again" in said[0]
    assert_same(ref, run(model))
    moepage.unwrap(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = _load(path, k, tmp_path, torch.bfloat16, compress=coded)
    assert not [w for w in caught if "not reused" in str(w.message)]
    assert_same(ref, run(again))


def test_a_damaged_layout_of_another_checkpoint_dropped_by_a_load_is_said_by_that_load(checkpoint, tmp_path):
    """A load that keeps its own layout drops another checkpoint's whose rows file was cut short: it says so, naming
    that checkpoint and the file; that checkpoint's next load lays its rows out again."""
    import warnings

    q, kq = checkpoint("qwen3_moe", "per_expert")
    m, km = checkpoint("mixtral", "per_expert")
    moepage.unwrap(_load(q, kq, tmp_path, torch.bfloat16))
    damaged = _damage_folder(tmp_path, "rows file truncated", coded=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moepage.unwrap(_load(m, km, tmp_path, torch.bfloat16))
    said = [str(w.message) for w in caught if "not reused" in str(w.message)]
    assert len(said) == 1 and f"expert rows of {q} " in said[0] and f"{damaged} is shorter" in said[0], said
    assert_same(run(reference(q, torch.bfloat16, "eager")), run(_load(q, kq, tmp_path, torch.bfloat16)))


def test_rows_no_layout_names_and_no_process_holds_are_swept(checkpoint, tmp_path):
    """What a killed process, a moved folder or an unreadable manifest left goes at the next load; a file another
    user holds stays."""
    from moepage.backends import folder as rows_folder

    path, k = checkpoint("qwen3_moe", "per_expert")
    (tmp_path / "rows-left-behind.moepage").write_bytes(b"x" * 100)
    held = tmp_path / "rows-in-use.moepage"
    held.write_bytes(b"y" * 100)
    rows_folder.hold(str(held))
    try:
        _load(path, k, tmp_path, torch.bfloat16)
        assert not (tmp_path / "rows-left-behind.moepage").exists() and held.exists()
    finally:
        rows_folder.release(str(held))


def _damage_reads(patch) -> None:
    """Every read from disk comes back with its first byte flipped (the disk's own damage: no identity changes)."""
    read = disk.OsFile.readinto

    def damaged(self, buf, offset):
        got = read(self, buf, offset)
        buf[0] = buf[0] ^ 0xFF
        return got

    patch.setattr(disk.OsFile, "readinto", damaged)


def test_a_layout_whose_rows_fail_their_checksum_is_dropped(checkpoint, tmp_path, monkeypatch):
    """Rows kept by an earlier load that no longer match their checksums (the disk's own damage: no identity
    changed) fail the load that reuses them, naming the file; that layout is dropped, and the next load is exact."""
    path, k = checkpoint("qwen3_moe", "per_expert")
    moepage.unwrap(_load(path, k, tmp_path, torch.bfloat16))
    spilled = "|".join(str(tmp_path / n) for n in _spilled(tmp_path))
    with monkeypatch.context() as m:
        _damage_reads(m)
        with pytest.raises(PageInError, match=rf"({spilled}).*checksum mismatch.*dropped from .*: load again"):
            _load(path, k, tmp_path, torch.bfloat16)
    assert _named(tmp_path) == []
    again = _load(path, k, tmp_path, torch.bfloat16)
    assert_same(run(reference(path, torch.bfloat16, "eager")), run(again))


def test_a_warm_trace_fills_each_host_tier_at_load(checkpoint, tmp_path):
    """``from_pretrained(..., host_warm=TRACE)``: each layer's host tier holds the trace's most routed experts of that
    layer once loaded; outputs equal unpaged."""
    import numpy as np

    from moepage.planning.traces import save_simple

    path, k = checkpoint("mixtral", "per_expert")
    hot = ((6, 7, 5, 1), (2, 0, 4, 3))
    ids = np.full((10, 2, 4), -1, dtype=np.int32)
    for layer, experts in enumerate(hot):
        for i, e in enumerate(experts):
            ids[: 10 - 2 * i, layer, i] = e
    save_simple(tmp_path / "trace.npz", ids, 8, 2)
    ref = run(reference(path, torch.float32, "grouped_mm"))
    model = _load(path, k, tmp_path / "rows", h=k + 1, host_warm=tmp_path / "trace.npz")
    layers = list(moepage.paged_layers(model))
    for layer, experts in zip(layers, hot):
        tier = layer.store._layers[layer.name].residency
        assert {e for e in range(8) if tier.expert_slot[e] >= 0} == set(experts[: k + 1])
    assert moepage.stats(model).total.host_misses == 0  # read at load, not by a step
    assert_same(ref, run(model))
    moepage.unwrap(model)


def test_an_unreadable_warm_trace_is_said_with_the_other_problems_before_the_checkpoint_is_read(checkpoint, tmp_path):
    path, k = checkpoint("mixtral", "per_expert")
    with pytest.raises(moepage.ConfigError) as info:
        _load(path, k, tmp_path / "rows", policy="sometimes", host_warm=tmp_path / "missing.npz")
    text = str(info.value)
    assert text.startswith(f"moepage.integrations.transformers.from_pretrained: cannot load {path}")
    assert "sometimes" in text and "missing.npz" in text
    assert not (tmp_path / "rows").exists()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_coded_rows_on_disk_equal_unpaged_and_the_raw_rows_never_sit_in_memory(checkpoint, tmp_path, monkeypatch,
                                                                                arch):
    """``from_pretrained(..., compress=True)`` with a disk tier: the loader's raw rows are staged on disk (read in place
    from the checkpoint where they lie there), one layer's read back at a time to be coded; no host store ever holds
    every layer's raw rows. Rows are kept coded on disk and in the host tier; equal to unpaged."""
    from moepage.backends import torch as torch_store

    def refuse(*args, **kwargs):
        raise AssertionError("every raw row staged in host memory")

    monkeypatch.setattr(torch_store.TorchStore, "allocate", refuse)
    path, k = checkpoint(arch, "per_expert")
    ref = run(reference(path, torch.bfloat16, "eager"))
    model = _load(path, k, tmp_path, torch.bfloat16, h=k + 1, compress=True)
    assert_same(ref, run(model))
    for where, held in moepage.host_bytes(model).items():
        assert held.coded and held.held < held.raw, where
    for layer in moepage.paged_layers(model):
        tier = layer.store.tier_stats(layer.name)
        assert tier.host_misses > 0  # each read one expert's coded bytes, not its raw ones
        assert tier.disk_bytes == tier.host_misses * sum(s.host_nbytes for s in layer.specs.values())
        assert all(s.code is not None for s in layer.specs.values())
    moepage.unwrap(model)


@pytest.mark.parametrize("compress", [False, True])
def test_new_weights_loaded_after_the_layout_was_kept_are_written_apart(checkpoint, tmp_path, compress):
    """``load_state_dict`` into a model whose rows' layout was kept for later loads: the new rows go to a spill file
    of their own (the kept one is sealed; coded, to the store's own file, which no layout names), read back and step
    exactly as edited; the kept layout still stands for the checkpoint as it is, so the next load reads the
    checkpoint's rows, and the edits' file goes at unwrap."""
    path, k = checkpoint("qwen3_moe", "per_expert")
    model = _load(path, k, tmp_path, torch.bfloat16, compress=compress)
    kept, spilled, named = (tmp_path / "manifest.json").read_text(), _spilled(tmp_path), _named(tmp_path)
    state = {n: t.clone() for n, t in model.state_dict().items()}
    key = next(n for n in state if n.endswith("experts.down_proj"))
    state[key][3] = -state[key][3]  # one expert's rows edited (the same exponents: it fits the code)
    model.load_state_dict(state)
    assert torch.equal(model.state_dict()[key], state[key])
    edited = reference(path, torch.bfloat16, "eager")
    edited.load_state_dict(state)
    assert_same(run(edited), run(model))
    assert (tmp_path / "manifest.json").read_text() == kept
    if not compress:  # (coded, the rows are written to the store's own files, which no layout names)
        assert len(_spilled(tmp_path)) == len(spilled) + FILES  # a new file a tensor
    moepage.unwrap(model)
    assert _spilled(tmp_path) == _named(tmp_path) == named  # the edits' file went with the store; the kept ones stay
    assert_same(run(reference(path, torch.bfloat16, "eager")), run(_load(path, k, tmp_path, torch.bfloat16,
                                                                           compress=compress)))


def test_a_coded_load_checks_the_folder_has_room_for_every_row_first(checkpoint, tmp_path, monkeypatch):
    """Coded, every row is written to the folder (even where the checkpoint's own lie in place): a folder without
    room for them is refused before the checkpoint is read, naming it; a load that writes nothing is not."""
    from types import SimpleNamespace

    path, k = checkpoint("qwen3_moe", "per_expert")
    monkeypatch.setattr("shutil.disk_usage", lambda p: SimpleNamespace(total=1 << 30, used=1 << 30, free=4096))
    with pytest.raises(moepage.ConfigError, match="of expert rows to write there"):
        _load(path, k, tmp_path / "rows", torch.bfloat16, compress=True)
    assert not (tmp_path / "rows").exists() or _spilled(tmp_path / "rows") == []
    model = _load(path, k, tmp_path / "rows")  # its own dtype, raw: every row read in place, nothing written
    assert _spilled(tmp_path / "rows") == []
    moepage.unwrap(model)


def test_a_store_collected_inside_its_folders_lock_lets_go_once_the_lock_is_free(checkpoint, tmp_path):
    """A load left unclosed (one that failed, say) is let go by the garbage collector, which may run inside the next
    load's locked section of the same folder: its teardown waits for that lock's release instead of on itself (a
    suite hung so)."""
    import threading

    from moepage.backends import folder

    path, k = checkpoint("qwen3_moe", "stacked")
    model = _load(path, k, tmp_path, torch.bfloat16, h=k + 1)  # rows cast and kept: held, named by the manifest
    store = next(moepage.paged_layers(model)).pager.store
    assert store.files.held and not store.files.owned
    done = []

    def collected_inside_the_lock() -> None:
        with folder.locked(str(tmp_path)):
            store._finalizer()  # what the collector calls
            done.append(bool(store.files.held))  # still held: it waits for the lock
        done.append(bool(store.files.held))

    thread = threading.Thread(target=collected_inside_the_lock, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the teardown waited on the lock its own thread holds"
    assert done == [True, False]  # let go once the lock was free
    assert_same(run(reference(path, torch.bfloat16, "eager")), run(_load(path, k, tmp_path, torch.bfloat16, h=k + 1)))


def test_a_second_coded_load_takes_the_coded_rows_as_kept_and_codes_nothing(checkpoint, tmp_path, monkeypatch,
                                                                               caplog):
    """``compress=True``: the first load keeps its coded rows (and their codes) in the folder beside the raw layout;
    the next load of the same checkpoint reads no row back and codes nothing, and is equal to unpaged; damaged coded
    rows fail that load naming the file and are dropped, so the load after codes them anew; a changed checkpoint is
    not served the old coded rows."""
    from moepage import compress, lifetime

    source, k = checkpoint("mixtral", "per_expert")
    path = str(tmp_path / "ckpt")
    shutil.copytree(source, path)
    tmp_path = tmp_path / "rows"
    ref = run(reference(path, torch.bfloat16, "eager"))
    moepage.unwrap(_load(path, k, tmp_path, torch.bfloat16, compress=True))
    layouts = json.loads((tmp_path / "manifest.json").read_text())["layouts"]
    coded = [x for x in layouts if x["source"].get("coded")]
    assert len(coded) == 1 and set(coded[0]["codes"]) == set(coded[0]["rows"])  # every tensor's code kept

    def refuse(*args, **kwargs):
        raise AssertionError("coded again")

    with monkeypatch.context() as m:
        m.setattr(compress, "encode_rows", refuse)
        m.setattr(lifetime, "plan_code", refuse)
        with caplog.at_level("INFO", logger="moepage"):
            again = _load(path, k, tmp_path, torch.bfloat16, compress=True)
    assert "coded expert rows reused" in caplog.text
    assert_same(ref, run(again))
    assert all(held.coded for held in moepage.host_bytes(again).values())
    moepage.unwrap(again)
    files = [f[0] for f in coded[0]["files"]]
    with monkeypatch.context() as m:
        _damage_reads(m)
        with pytest.raises(PageInError, match="|".join(files)):
            _load(path, k, tmp_path, torch.bfloat16, compress=True)
    assert not [x for x in json.loads((tmp_path / "manifest.json").read_text())["layouts"] if x["source"].get("coded")]
    assert_same(ref, run(_load(path, k, tmp_path, torch.bfloat16, compress=True)))  # coded anew
    weights = os.path.join(path, "model.safetensors")
    shutil.copy(weights, weights + ".new")
    os.replace(weights + ".new", weights)  # the same bytes in a new file: the checkpoint changed
    planned = []
    with monkeypatch.context() as m:
        m.setattr(lifetime, "plan_code", lambda *a, plan=lifetime.plan_code, **kw: planned.append(1) or plan(*a, **kw))
        model = _load(path, k, tmp_path, torch.bfloat16, compress=True)
    assert planned  # coded from the new file, not served the old coded rows
    assert_same(ref, run(model))


def _edit_layout(folder, coded: bool, edit) -> None:
    """Apply ``edit`` to the (coded or raw) layout in ``folder``'s manifest, as damage or another version would."""
    path = folder / "manifest.json"
    data = json.loads(path.read_text())
    edit(next(x for x in data["layouts"] if bool(x["source"].get("coded")) == coded))
    path.write_text(json.dumps(data))


def _crc_of_last_expert(layout) -> None:
    layout["rows"]["model.layers.0.mlp.experts\tgate_up_proj"][-1][0][3] ^= 1  # beyond K: no load reads it


@pytest.mark.parametrize("compress", [False, True])
def test_rows_found_damaged_after_load_drop_their_layout_alone(checkpoint, tmp_path, compress):
    """Rows of a reused layout found damaged when first read, after the load (an expert beyond the K the load reads):
    ``DamagedRowsError`` naming the file, and that layout alone is dropped (coded: the raw one beside it stays), so
    the next load is exact."""
    from moepage.errors import DamagedRowsError

    source, k = checkpoint("qwen3_moe", "per_expert")  # fp32 loaded as bf16: the raw rows are spilled too
    ref = run(reference(source, torch.bfloat16, "eager"))
    moepage.unwrap(_load(source, k, tmp_path, torch.bfloat16, compress=compress))
    _edit_layout(tmp_path, compress, _crc_of_last_expert)
    model = _load(source, k, tmp_path, torch.bfloat16, compress=compress)
    with pytest.raises(DamagedRowsError, match="checksum mismatch.*layout they belong to is dropped from"):
        model.state_dict()  # every row read
    layouts = json.loads((tmp_path / "manifest.json").read_text())["layouts"]
    assert [bool(x["source"].get("coded")) for x in layouts] == ([False] if compress else [])
    del model
    gc.collect()
    assert_same(ref, run(_load(source, k, tmp_path, torch.bfloat16, compress=compress)))


@pytest.mark.parametrize("damage", ["a code missing", "a code unreadable", "a row too short"])
def test_a_coded_layout_this_version_cannot_serve_is_coded_anew_not_served(checkpoint, tmp_path, monkeypatch, damage):
    """A kept coded layout lacking a tensor's code, with a code it cannot read, or with rows of other sizes than
    their code's (a damaged manifest, another version's) is never served: the load codes anew, exactly (a warning
    says why), and keeps the new layout in its place, which the next load reuses."""
    from moepage import lifetime

    source, k = checkpoint("mixtral", "per_expert")
    ref = run(reference(source, torch.bfloat16, "eager"))
    moepage.unwrap(_load(source, k, tmp_path, torch.bfloat16, compress=True))
    key = "model.layers.1.mlp.experts\tdown_proj"

    def edit(layout):
        if damage == "a code missing":
            del layout["codes"][key]
        elif damage == "a code unreadable":
            layout["codes"][key] = [1, 2]
        else:
            layout["rows"][key][0][0][2] -= 16

    _edit_layout(tmp_path, True, edit)
    planned = []
    said = ("its record in the manifest could not be read" if damage == "a code unreadable" else
            r"the rows it lays out of model.layers.1.mlp.experts.down_proj are not whole or not of the bytes")
    with monkeypatch.context() as m, pytest.warns(UserWarning, match=rf"coded expert rows of .* not reused because "
                                                                     f"{said}"):
        m.setattr(lifetime, "plan_code", lambda *a, plan=lifetime.plan_code, **kw: planned.append(1) or plan(*a, **kw))
        model = _load(source, k, tmp_path, torch.bfloat16, compress=True)
    assert planned  # coded anew
    assert_same(ref, run(model))
    moepage.unwrap(model)

    def refuse(*args, **kwargs):
        raise AssertionError("coded again")

    monkeypatch.setattr(lifetime, "plan_code", refuse)
    assert_same(ref, run(_load(source, k, tmp_path, torch.bfloat16, compress=True)))  # the new layout, reused


def test_a_spill_folder_that_cannot_be_made_is_refused_before_the_checkpoint_is_read(checkpoint, monkeypatch):
    import safetensors

    path, k = checkpoint("qwen3_moe", "per_expert")
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("read")))
    with pytest.raises(moepage.ConfigError, match=r"spill_dir='/proc/x': /proc/x cannot be created"):
        _load(path, k, "/proc/x")


def test_a_home_relative_spill_dir_is_the_homes(checkpoint, tmp_path, monkeypatch):
    path, k = checkpoint("qwen3_moe", "per_expert")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    model = _load(path, k, "~/rows", torch.bfloat16)  # cast: every row written into the folder
    assert len(_spilled(tmp_path / "home" / "rows")) == FILES and not (tmp_path / "~").exists()
    moepage.unwrap(model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cast_load_checks_the_folder_has_room_for_every_row_first(checkpoint, tmp_path, monkeypatch, dtype):
    """Cast on load (the fp32 checkpoint as bf16 or fp16), every row is written into the folder, none read in place:
    a folder without room for them is refused before any row is written, naming the argument, the bytes to write
    and the bytes free; with room, the rows written fit what it counted."""
    from types import SimpleNamespace

    from moepage.nn.find import find_experts
    from moepage.units import format_bytes

    path, k = checkpoint("qwen3_moe", "per_expert")
    need = sum(m.down_proj.shape[0] * (2 * disk.aligned(m.gate_up_proj[0].nbytes // 2) + disk.aligned(
        m.down_proj[0].nbytes)) for _, m in find_experts(reference(path, dtype, "eager")))  # gate, up: a part each
    monkeypatch.setattr("shutil.disk_usage", lambda p: SimpleNamespace(total=1 << 30, used=1 << 30, free=12288))
    with pytest.raises(moepage.ConfigError, match=rf"spill_dir='.*rows': {format_bytes(need)} of expert rows to "
                                                  rf"write there, {format_bytes(12288)} free"):
        _load(path, k, tmp_path / "rows", dtype)
    assert not (tmp_path / "rows").exists() or _spilled(tmp_path / "rows") == []
    monkeypatch.undo()
    model = _load(path, k, tmp_path / "rows", dtype)
    assert 0 < sum(os.path.getsize(tmp_path / "rows" / n) for n in _spilled(tmp_path / "rows")) <= need
    moepage.unwrap(model)


def _rot(weights, folder) -> None:
    """Bytes of an expert of ``weights`` changed as the disk's own damage changes them: its identity as moepage recorded
    it unchanged (a write moves the change time, which rot does not, so the manifest's records of it move along)."""
    from moepage.planning.sizing import read_header

    real = os.path.realpath(weights)
    at = next(t.offset for t in read_header(str(weights)) if ".experts.0." in t.name) + 8
    data = bytearray(weights.read_bytes()[at : at + 8])
    with open(weights, "r+b") as f:
        f.seek(at)
        f.write(bytes(b ^ 0x5A for b in data))
    now = disk.Identity.of(real).record()
    manifest = json.loads((folder / "manifest.json").read_text())
    for layout in manifest["layouts"]:
        for entry in layout["files"]:
            if entry[0] == real:
                entry[1:] = now
        if real in layout["source"].get("files", {}):
            layout["source"]["files"][real] = now
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_whose_bytes_rotted_is_sent_back_to_the_checkpoint_and_refused_until_replaced(checkpoint,
                                                                                                  tmp_path):
    """Rows read in place from a checkpoint file whose bytes changed on disk, its identity unchanged: the load that
    reads them says the checkpoint's own bytes changed and to verify or download it again; a later load, read in place
    or cast, is refused naming the file (never laying the changed bytes out as the checkpoint's), until the file is
    replaced: then it is read afresh, exactly."""
    from moepage.errors import DamagedRowsError

    source, k = checkpoint("qwen3_moe", "per_expert")
    path = tmp_path / "ckpt"
    shutil.copytree(source, path)
    weights, folder = path / "model.safetensors", tmp_path / "rows"
    moepage.unwrap(_load(str(path), k, folder))  # fp32: every row read in place, the layout kept
    _rot(weights, folder)
    with pytest.raises(DamagedRowsError, match=r"checksum mismatch.*checkpoint's own file.*verify the checkpoint"):
        _load(str(path), k, folder)
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(moepage.ConfigError, match=rf"{weights}.*earlier load found this file's rows damaged.*"
                                                      "download it again"):
            _load(str(path), k, folder, dtype)
    shutil.copy(os.path.join(source, "model.safetensors"), tmp_path / "w")
    os.replace(tmp_path / "w", weights)  # downloaded again
    assert_same(run(reference(source, torch.float32, "grouped_mm")), run(_load(str(path), k, folder)))


def test_rows_in_place_found_damaged_by_a_read_alone_are_taken_again_where_the_bytes_are_as_laid_out(checkpoint,
                                                                                                    tmp_path,
                                                                                                    monkeypatch):
    """A checksum mismatch the file's bytes do not bear out (a read's own fault): the next load finds the bytes its
    rows were laid out from and is exact."""
    from moepage.errors import DamagedRowsError

    path, k = checkpoint("qwen3_moe", "per_expert")
    moepage.unwrap(_load(path, k, tmp_path))
    read = disk.OsFile.readinto

    def damaged(self, buf, offset):  # every byte: a row in place lies anywhere in the aligned span read
        got = read(self, buf, offset)
        buf[:got] = bytes(b ^ 0xFF for b in buf[:got])
        return got

    with monkeypatch.context() as m:
        m.setattr(disk.OsFile, "readinto", damaged)
        with pytest.raises(DamagedRowsError, match="checkpoint's own file"):
            _load(path, k, tmp_path)
    assert json.loads((tmp_path / "manifest.json").read_text())["damaged"]  # remembered, and not held against it
    assert_same(run(reference(path, torch.float32, "grouped_mm")), run(_load(path, k, tmp_path)))


def test_the_progress_bar_says_where_the_rows_came_from(checkpoint, tmp_path, capsys, monkeypatch):
    """With progress on, a user sees without any logging set up how the rows were laid out, and that a second load
    of the same checkpoint wrote none: the raw rows (the loading bar) and, with compress=True, the coded ones (the
    coding bar)."""
    import sys

    path, k = checkpoint("qwen3_moe", "per_expert")

    def loaded(dtype) -> str:
        model = _load(path, k, tmp_path, dtype, progress=True)
        moepage.unwrap(model)
        return capsys.readouterr().err.replace("\r", "\n").splitlines()[-1]

    e, rows = configs()["qwen3_moe"][0].num_experts, 2 * 2  # two MoE layers, two tensors each
    assert f"expert rows: {e * rows} read in place, 0 written to {tmp_path}" in loaded(torch.float32)
    assert f"expert rows: 0 read in place, {e * rows} written to {tmp_path}" in loaded(torch.bfloat16)
    assert f"expert rows reused from {tmp_path}: 0 written" in loaded(torch.bfloat16)
    moepage.unwrap(_load(path, k, tmp_path, torch.bfloat16, progress=True, compress=True))  # (not on a terminal)
    err = capsys.readouterr().err.replace("\r", "\n")
    assert f"raw expert rows reused from {tmp_path}: 0 written" in err and "coding host rows" in err
    assert f"coded expert rows: {e * rows} written to {tmp_path}" in err.splitlines()[-1]  # what the coding did
    moepage.unwrap(_load(path, k, tmp_path, torch.bfloat16, progress=True, compress=True))
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "coding host rows" not in err  # the coded rows the last load kept: none coded
    assert f"coded expert rows reused from {tmp_path}: 0 written" in err.splitlines()[-1]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # progress off: no bar, on a terminal too
    moepage.unwrap(_load(path, k, tmp_path / "other", torch.bfloat16, progress=False, compress=True))
    assert "moepage:" not in capsys.readouterr().err
