"""Rows an engine's loader takes unchanged from the checkpoint, read where the checkpoint holds them
(``moepage.integrations.inplace``), with loaders that place, cast, stack or change what they load: every row reads
back as the loader wrote it, whatever went where, and a checkpoint changed afterwards fails the read, naming it."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from moepage.backends.protocol import RowSpec
from moepage.backends.tiered import TieredStore
from moepage.errors import PageInError
from moepage.integrations.inplace import CheckpointIndex, RowsInPlace

E, I, H = 4, 8, 16  # experts; a fused row is [2I, H] (gate, then up)


@pytest.fixture()
def ckpt(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"e{e}.{p}": torch.randn(I, H, generator=g) for e in range(E) for p in ("gate", "up")}
    tensors["twin"] = tensors["e0.gate"].clone()  # the same bytes twice: either place holds them
    ends = tensors["e1.gate"].clone()
    ends[I // 2] += 1  # the same first and last bytes, other bytes between
    tensors["ends"] = ends
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def _rows(tmp_path, dtype=torch.float32):
    path = tmp_path / "staged"
    with open(path, "wb") as f:
        f.truncate(E * 2 * I * H * dtype.itemsize)
    return torch.from_file(str(path), shared=True, size=E * 2 * I * H, dtype=dtype).view(E, 2 * I, H)


INITIAL = 7.0


def _plan(ckpt, tmp_path, dtype=torch.float32):
    staged = {"w13": _rows(tmp_path, dtype)}
    return RowsInPlace(CheckpointIndex([str(ckpt[0])]), staged, lambda n, e: torch.full((2 * I, H), INITIAL))


def _load(plan, expert, part, loaded, change=lambda t: t):
    """A fused-row loader: ``loaded`` (changed by ``change``) into part 0 (gate) or 1 (up) of row ``expert``."""

    def write(rows):
        rows[expert, part * I : (part + 1) * I].copy_(change(loaded))
        return "written"

    return plan.load("w13", expert, loaded, write)


def _expected(tensors, loads, dtype=torch.float32):
    want = torch.full((E, 2 * I, H), INITIAL).to(dtype)
    for expert, part, key, change in loads:
        want[expert, part * I : (part + 1) * I] = change(tensors[key]).to(dtype)
    return want


def _laid_out(plan, tmp_path, dtype=torch.float32):
    """The rows as a tiered store reads them back after ``settle`` (extents in the checkpoint, the rest from the
    staged file), and which experts went where."""
    in_checkpoint, in_file = plan.settle()
    store = TieredStore(tmp_path / "spill", lambda layer, e, k: e)
    store.allocate("l", {"w13": RowSpec((2 * I, H), dtype)}, E, 2, torch.device("cpu"))
    store.place_file("l", "w13", str(tmp_path / "staged"), in_file["w13"])
    for e, extents in in_checkpoint["w13"].items():
        store.place_extents("l", "w13", e, extents)
    rows = torch.stack([_read(store, e, dtype) for e in range(E)])
    return rows, sorted(in_checkpoint["w13"]), in_file["w13"], store


def _read(store, e, dtype):
    """Row ``e`` from its files (not the host tier)."""
    out = torch.empty(2 * I, H, dtype=dtype)
    store.disk.read("l", "w13", e, out)
    return out


def test_rows_taken_unchanged_are_read_from_the_checkpoint(ckpt, tmp_path):
    path, tensors = ckpt
    plan = _plan(ckpt, tmp_path)
    loads = [(e, p, f"e{e}.{'gate' if p == 0 else 'up'}", lambda t: t) for e in range(E) for p in (1, 0)]
    for e, p, key, _ in loads:  # up before gate: where a part lands is read from the row, not assumed
        assert _load(plan, e, p, tensors[key]) == "written"
    rows, in_checkpoint, in_file, _ = _laid_out(plan, tmp_path)
    assert in_checkpoint == list(range(E)) and in_file == []
    assert torch.equal(rows, _expected(tensors, loads))
    assert not (tmp_path / "staged").exists()  # no row in the staged file: it went at once


def test_rows_are_found_in_place_under_an_engine_s_default_device(ckpt, tmp_path):
    """Engines build their models under a default device (SGLang: CUDA): the plan's own buffers stay on the CPU, where
    the checkpoint's bytes are compared (a scratch row made on the default device failed the first load on a GPU).
    The meta device stands in for CUDA here: any tensor made on it cannot be read."""
    _, tensors = ckpt
    with torch.device("meta"):
        plan = _plan(ckpt, tmp_path)
        loads = [(e, p, f"e{e}.{'gate' if p == 0 else 'up'}", lambda t: t) for e in range(E) for p in (0, 1)]
        for e, p, key, _ in loads:
            assert _load(plan, e, p, tensors[key]) == "written"
    rows, in_checkpoint, in_file, _ = _laid_out(plan, tmp_path)
    assert in_checkpoint == list(range(E)) and in_file == []
    assert torch.equal(rows, _expected(tensors, loads))


def test_a_changed_part_or_a_part_missing_stages_its_row(ckpt, tmp_path):
    """Expert 0: gate in place, then up changed by the loader (the row goes to the staged file, the gate read back
    into it); expert 1 in place; expert 2: gate alone (the rest keeps its initial value); expert 3 never loaded."""
    _, tensors = ckpt
    plan = _plan(ckpt, tmp_path)
    same, double = (lambda t: t), (lambda t: t * 2)
    loads = [(0, 0, "e0.gate", same), (0, 1, "e0.up", double), (1, 1, "e1.up", same), (1, 0, "e1.gate", same),
             (2, 0, "e2.gate", same)]
    for e, p, key, change in loads:
        _load(plan, e, p, tensors[key], change)
    rows, in_checkpoint, in_file, _ = _laid_out(plan, tmp_path)
    assert in_checkpoint == [1] and in_file == [0, 2, 3]
    assert torch.equal(rows, _expected(tensors, loads))


def test_a_stacked_tensor_stages_every_row_with_what_was_found_in_place(ckpt, tmp_path):
    _, tensors = ckpt
    plan = _plan(ckpt, tmp_path)
    _load(plan, 0, 0, tensors["e0.gate"])

    def stacked(rows):  # every expert's up at once (a checkpoint storing the experts stacked)
        for e in range(E):
            rows[e, I:].copy_(tensors[f"e{e}.up"])

    plan.load("w13", None, torch.stack([tensors[f"e{e}.up"] for e in range(E)]), stacked)
    rows, in_checkpoint, in_file, _ = _laid_out(plan, tmp_path)
    assert in_checkpoint == [] and in_file == list(range(E))
    loads = [(0, 0, "e0.gate", lambda t: t)] + [(e, 1, f"e{e}.up", lambda t: t) for e in range(E)]
    assert torch.equal(rows, _expected(tensors, loads))


def test_a_checkpoint_in_another_dtype_is_staged(ckpt, tmp_path):
    _, tensors = ckpt
    plan = _plan(ckpt, tmp_path, torch.bfloat16)
    loads = [(e, p, f"e{e}.{'gate' if p == 0 else 'up'}", lambda t: t) for e in range(E) for p in (0, 1)]
    for e, p, key, _ in loads:
        _load(plan, e, p, tensors[key], lambda t: t.to(torch.bfloat16))
    rows, in_checkpoint, in_file, _ = _laid_out(plan, tmp_path, torch.bfloat16)
    assert in_checkpoint == [] and in_file == list(range(E))
    assert torch.equal(rows, _expected(tensors, loads, torch.bfloat16))


def test_tensors_found_by_their_bytes(ckpt):
    path, tensors = ckpt
    index = CheckpointIndex([str(path)])

    def at(t):
        return index.locate(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))

    twin = at(tensors["e0.gate"])  # two places hold these bytes: either
    assert twin is not None and twin in {at(tensors["twin"]), _offset(path, "e0.gate")}
    assert at(tensors["e1.gate"]) == _offset(path, "e1.gate") != at(tensors["ends"]) == _offset(path, "ends")
    assert at(tensors["e1.gate"] + 1) is None and at(tensors["e1.gate"][: I // 2]) is None


def _offset(path, key):
    from moepage.planning.sizing import read_header

    return str(path.resolve()), next(t.offset for t in read_header(path) if t.name == key)


def test_a_checkpoint_changed_after_the_load_fails_the_read_naming_it(ckpt, tmp_path):
    path, tensors = ckpt
    plan = _plan(ckpt, tmp_path)
    for e in range(E):
        _load(plan, e, 0, tensors[f"e{e}.gate"])
        _load(plan, e, 1, tensors[f"e{e}.up"])
    *_, store = _laid_out(plan, tmp_path)
    with open(path, "r+b") as f:  # the bytes of one row, changed in place (the size stays)
        _, offset = _offset(path, "e2.up")
        f.seek(offset)
        f.write(b"\0" * 8)
    with pytest.raises(PageInError, match=str(path.resolve())):
        _read(store, 2, torch.float32)


def test_one_index_per_checkpoint_as_it_is(ckpt):
    """Every layer of a load shares the checkpoint's index (built once); a file changed since gets a new one."""
    path, _ = ckpt
    first = CheckpointIndex.of([str(path)])
    assert CheckpointIndex.of([str(path)]) is first
    os.utime(path, ns=(1, 1))
    assert CheckpointIndex.of([str(path)]) is not first


def test_a_part_is_found_where_this_write_put_it_not_where_equal_bytes_were_left(tmp_path):
    """Expert 1's up holds the same bytes as expert 0's gate: the scratch row still holding expert 0's gate must not
    pass for where expert 1's up went (its row would lose its up)."""
    g = torch.Generator().manual_seed(1)
    tensors = {"g0": torch.randn(I, H, generator=g), "u0": torch.randn(I, H, generator=g),
               "g1": torch.randn(I, H, generator=g)}
    tensors["u1"] = tensors["g0"].clone()
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    plan = _plan((path, tensors), tmp_path)
    loads = [(0, 0, "g0"), (0, 1, "u0"), (1, 1, "u1"), (1, 0, "g1")]
    for e, p, key in loads:
        _load(plan, e, p, tensors[key])
    rows, in_checkpoint, in_file, _ = _laid_out(plan, tmp_path)
    assert torch.equal(rows[:2], _expected(tensors, [(e, p, k, lambda t: t) for e, p, k in loads])[:2])
    assert in_checkpoint == [0, 1]


def test_a_rank_s_rows_of_gate_and_up_are_read_in_place_its_columns_of_down_are_staged(tmp_path):
    """TP = 2, rank 1: the loader puts the second half of gate's and up's rows (a run of each tensor in the file)
    into the fused row, and the second half of down's columns (no run of the file) into its row."""
    g = torch.Generator().manual_seed(2)
    tensors = {f"e{e}.{p}": torch.randn(2 * I, H, generator=g) for e in range(E) for p in ("gate", "up")}
    tensors.update({f"e{e}.down": torch.randn(H, 2 * I, generator=g) for e in range(E)})
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    index = CheckpointIndex([str(path)])
    staged = {"w13": _rows(tmp_path), "w2": torch.zeros(E, H, I)}
    (tmp_path / "staged").rename(tmp_path / "w13")
    plan = RowsInPlace(index, staged, lambda n, e: torch.full(staged[n].shape[1:], INITIAL))
    for e in range(E):
        for p, key in ((0, "gate"), (1, "up")):
            shard = tensors[f"e{e}.{key}"]

            def write(rows, shard=shard, p=p, e=e):
                rows[e, p * I : (p + 1) * I].copy_(shard[I:])

            plan.load("w13", e, shard, write)

        def write_down(rows, e=e):
            rows[e].copy_(tensors[f"e{e}.down"][:, I:])

        plan.load("w2", e, tensors[f"e{e}.down"], write_down)
    in_checkpoint, in_file = plan.settle()
    assert sorted(in_checkpoint["w13"]) == list(range(E)) and in_file["w13"] == []
    assert in_checkpoint["w2"] == {} and in_file["w2"] == list(range(E))
    for e, extents in in_checkpoint["w13"].items():
        got = b"".join(open(path, "rb").read()[x.offset : x.offset + x.nbytes] for x in extents)
        want = torch.cat([tensors[f"e{e}.gate"][I:], tensors[f"e{e}.up"][I:]])
        assert got == want.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert all(torch.equal(staged["w2"][e], tensors[f"e{e}.down"][:, I:]) for e in range(E))


def test_rows_whose_checkpoint_bytes_rotted_send_the_user_to_it_and_a_later_start_is_refused(ckpt, tmp_path):
    """The engines' path: a row read in place that fails its checksum while the checkpoint's identity stays (the
    disk's own damage) says the checkpoint's bytes changed and to verify or download it again; the spill folder
    remembers it, and a later start whose loader brings the changed bytes is refused naming the file, not served."""
    from safetensors.torch import load_file

    from moepage.backends.disk import Identity
    from moepage.errors import ConfigError, DamagedRowsError

    path, tensors = ckpt
    plan = _plan(ckpt, tmp_path)
    for e in range(E):
        _load(plan, e, 0, tensors[f"e{e}.gate"])
        _load(plan, e, 1, tensors[f"e{e}.up"])
    *_, store = _laid_out(plan, tmp_path)
    real, offset = _offset(path, "e2.up")
    with open(path, "r+b") as f:  # bytes in the middle: the tensor's ends still find it
        f.seek(offset + 8)
        f.write(b"\x01" * 8)
    store.disk.identity[real] = Identity.of(real)  # as rot leaves it (a write moves the change time)
    with pytest.raises(DamagedRowsError, match=r"checksum mismatch.*checkpoint's own file.*verify the checkpoint"):
        store.read_row("l", "w13", 2)
    store.close()
    rotten = load_file(str(path))
    again = _plan((path, rotten), tmp_path)
    for e in range(E):
        _load(again, e, 0, rotten[f"e{e}.gate"])
        _load(again, e, 1, rotten[f"e{e}.up"])
    with pytest.raises(ConfigError, match=rf"expert 2 of 'w13' from {real}.*found this file's rows damaged"):
        _laid_out(again, tmp_path)
