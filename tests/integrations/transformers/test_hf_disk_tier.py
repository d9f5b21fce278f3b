"""``from_pretrained`` with a disk tier (``host_budget=``, ``spill_dir=``): every architecture's checkpoint, rows read
in place where the checkpoint's bytes are the rows and spilled where the load transforms them (a cast, a fused
gate/up), equal to the unpaged model; the layout kept and reused by the next load of the same checkpoint; a checkpoint
changed after load refused at the read and laid out again by the next load; loads of several checkpoints sharing a
folder leave no file that no manifest names."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import moepage
from helpers.hf import ARCHS, DTYPES, FORMATS, assert_same, configs, make_checkpoints, reference, run
from moepage.backends import disk
from moepage.errors import PageInError
from moepage.integrations import transformers as mhf

pytestmark = pytest.mark.usefixtures("one_thread")
CASES = [(a, f) for a in ARCHS for f in FORMATS if not (a == "gpt_oss" and f == "per_expert")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoints(tmp_path_factory)


def _load(path: str, k: int, folder, dtype=torch.float32, h: int | None = None, **more):
    impl = "grouped_mm" if dtype == torch.float32 else "eager"
    return mhf.from_pretrained(path, resident=k, device="cpu", dtype=dtype, experts_implementation=impl,
                               progress=False, host_budget=h or k, spill_dir=folder, **more)


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
    assert len(spilled) == 1
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
    assert _spilled(folder) != old and _spilled(folder) == _named(folder)
    assert_same(ref, run(again))
    del model


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
    assert len(_spilled(tmp_path)) == 3 and _spilled(tmp_path) == _named(tmp_path)
    again = _load(q, kq, tmp_path, torch.bfloat16)  # reused: nothing new
    assert len(_spilled(tmp_path)) == 3
    assert_same(run(reference(q, torch.bfloat16, "eager")), run(again))
    for model in (a, b, c, again):
        moepage.unwrap(model)
    assert len(_spilled(tmp_path)) == 3 and _spilled(tmp_path) == _named(tmp_path)


def test_two_loads_of_one_checkpoint_at_once_keep_one_layout(checkpoint, tmp_path, monkeypatch):
    """Both find no layout and write their rows; the second to keep finds the first's and its own file goes with it."""
    from moepage.backends import manifest

    path, k = checkpoint("qwen3_moe", "per_expert")
    found = manifest.find
    monkeypatch.setattr(manifest, "find", lambda *args: None)  # neither sees the other's layout yet
    a = _load(path, k, tmp_path, torch.bfloat16)
    b = _load(path, k, tmp_path, torch.bfloat16)
    monkeypatch.setattr(manifest, "find", found)
    assert len(_spilled(tmp_path)) == 2 and len(_named(tmp_path)) == 1
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
    assert layer.store.host_slots(layer.name) == k


def test_an_unreadable_host_budget_is_named_before_the_checkpoint_is_read(checkpoint, tmp_path, monkeypatch):
    from moepage.integrations.transformers import checkpoint as ckpt

    path, k = checkpoint("qwen3_moe", "per_expert")
    monkeypatch.setattr(ckpt, "checkpoint_files", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("read")))
    with pytest.raises(moepage.ConfigError, match=r"host_budget='lots': .*expected host rows per layer"):
        mhf.from_pretrained(path, resident=k, device="cpu", progress=False, host_budget="lots", spill_dir=tmp_path)
    assert os.listdir(tmp_path) == []
