"""A disk tier under the host rows (``host_budget=``, ``backends.tiered``): paged equals unpaged bit for bit with H < E
host rows across K, H, policies, dtypes and wave splits; host memory holds exactly H rows a layer; every fault of a
disk read (a short read, EIO, a checksum mismatch, a file changed after load) raises ``PageInError`` naming the file
and the expert and leaves both tiers consistent, so the next steps are exact again."""

from __future__ import annotations

import copy
import errno
import os
import random
from types import SimpleNamespace

import pytest
import torch

import moepage
from moepage.backends import disk as D
from moepage.backends.tiered import TieredStore
from moepage.bits import same_bits
from moepage.toy import ToyMoE

pytestmark = pytest.mark.usefixtures("single_thread")
E, TOP_K = 8, 2


def model_pair(dtype=torch.float32, layers: int = 2, seed: int = 0, hidden: int = 16):
    torch.manual_seed(seed)
    model = ToyMoE(vocab=40, hidden=hidden, inter=hidden // 2, layers=layers, num_experts=E, top_k=TOP_K)
    model = model.to(dtype).eval()
    return model, copy.deepcopy(model)


def prompts(rng: random.Random, n: int = 8):
    """Steps of one, two and many waves (a 40-token vocabulary routes widely)."""
    return [torch.tensor([rng.randrange(40) for _ in range(rng.choice([1, 2, 5, 17]))]) for _ in range(n)]


def rows_in(folder) -> list[str]:
    """The files of rows in ``folder`` (its lock file aside)."""
    return sorted(n for n in os.listdir(folder) if n.endswith(".moepage"))


def store_of(model) -> TieredStore:
    store = next(moepage.paged_layers(model)).store
    assert isinstance(store, TieredStore)
    return store


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,h", [(TOP_K, TOP_K), (TOP_K, 5), (4, 4), (4, 7), (E - 1, E - 1), (3, E - 1)])
@pytest.mark.parametrize("policy", ["lru", "lfu:3"])
def test_paged_equals_unpaged_with_rows_on_disk(tmp_path, dtype, k, h, policy):
    model, ref = model_pair(dtype, seed=k * 10 + h)
    moepage.wrap(model, k, host_budget=h, spill_dir=tmp_path, policy=policy)
    rng = random.Random(k * 100 + h)
    for ids in prompts(rng, 10):
        assert same_bits(model(ids), ref(ids)), ids
    total = moepage.stats(model).total
    assert total.host_hits + total.host_misses == total.misses  # every device miss went through the host tier
    if h < E:
        assert total.host_misses > 0 and total.disk_bytes > 0
    store = store_of(model)
    row = sum(p.nbytes for p in ref.blocks[0].experts.parameters()) // E
    assert store.host_bytes() == 2 * h * row  # host memory: exactly H rows a layer
    moepage.unwrap(model)
    for got, want in zip(model.parameters(), ref.parameters()):
        assert same_bits(got, want)


@pytest.mark.parametrize("k,h", [(TOP_K, TOP_K), (TOP_K, 5), (4, 7), (3, E - 1)])
@pytest.mark.parametrize("policy", ["lru", "lfu:3"])
def test_coded_rows_on_disk_page_exactly_and_are_read_coded(tmp_path, k, h, policy):
    """``compress=True`` with a disk tier: rows kept coded on disk and in the host tier, decoded into the slots; every
    step equal unpaged, host memory exactly H coded rows a layer, each host miss reads one expert's coded bytes."""
    model, ref = model_pair(torch.bfloat16, seed=k * 10 + h, hidden=64)
    moepage.wrap(model, k, host_budget=h, spill_dir=tmp_path, policy=policy, compress=True)
    store = store_of(model)
    coded = {layer.name: sum(s.host_nbytes for s in layer.specs.values()) for layer in moepage.paged_layers(model)}
    raw = sum(p.nbytes for p in ref.blocks[0].experts.parameters()) // E
    assert all(0 < c < raw for c in coded.values())
    rng = random.Random(k * 100 + h)
    for ids in prompts(rng, 10):
        assert same_bits(model(ids), ref(ids)), ids
    for layer in moepage.paged_layers(model):
        assert set(store.layer_bytes(layer.name).coded) == set(layer.specs)
        tier = store.tier_stats(layer.name)
        assert tier.disk_bytes == tier.host_misses * coded[layer.name]  # coded bytes read, not raw
    assert store.host_bytes() == h * sum(coded.values())
    moepage.unwrap(model)
    for got, want in zip(model.parameters(), ref.parameters()):
        assert same_bits(got, want)


@pytest.mark.parametrize("how", ["skips a row", "writes into host_rows"])
def test_a_loader_that_leaves_a_row_unwritten_is_refused_naming_it(tmp_path, how):
    """``wrap(load=...)`` over a disk tier: a row the loader never laid out (or wrote into ``host_rows``, a copy of a
    disk tier) is refused at wrap, naming the layer, tensor and experts, before any step could read it as nothing;
    the model is left as it was and no row stays on disk. A read of such a row raises, never returns stale bytes."""
    model, ref = model_pair()
    params = {f"{name}.{n}": p for name, sub in model.named_modules() if hasattr(sub, "gate_up_proj")
              for n, p in sub.named_parameters()}

    def load(store, layers):
        for layer, specs in layers.items():
            for n in specs:
                for e in range(E):
                    row = params[f"{layer}.{n}"][e]
                    if how == "writes into host_rows":
                        store.host_rows(layer, n)[e].copy_(row)
                    elif e != 5:
                        store.place_row(layer, n, e, row)

    with pytest.raises(moepage.MoepageError) as info:  # (reading host_rows first: the row it would copy is unwritten)
        moepage.wrap(model, 3, host_budget=4, spill_dir=tmp_path, load=load)
    if how == "skips a row":
        assert "left rows of the disk tier unwritten: blocks.0.experts.gate_up_proj: experts 5" in str(info.value)
    else:
        assert "expert 0 of 'gate_up_proj' was never laid out" in str(info.value)
    assert "place_row" in str(info.value)
    assert not list(moepage.paged_layers(model)) and rows_in(tmp_path) == []
    assert same_bits(model(torch.arange(20)), ref(torch.arange(20)))
    rows = D.DiskRows()
    rows.declare("l", "w", 2)
    with pytest.raises(moepage.PageInError, match="expert 1 of 'w' was never laid out"):
        rows.read("l", "w", 1, torch.empty(4))


@pytest.mark.parametrize("compress", [False, True])
def test_new_weights_replace_their_rows_on_disk_whole_or_not_at_all(tmp_path, monkeypatch, compress):
    """``load_state_dict`` over a disk tier (raw or coded): each tensor's new rows go to a new file and switch over
    once all are written, the old file going then, so repeated loads keep the folder's size; a write that fails
    midway (a full disk) leaves the old rows whole and its file gone, and the model exact."""
    model, ref = model_pair(torch.bfloat16, hidden=64) if compress else model_pair()
    moepage.wrap(model, 3, host_budget=4, spill_dir=tmp_path, compress=compress)

    def used():
        return sorted(os.path.getsize(tmp_path / n) for n in rows_in(tmp_path))

    before = used()
    for _ in range(3):
        model.load_state_dict(ref.state_dict())
    assert used() == before
    state = {n: -t if "experts" in n else t for n, t in ref.state_dict().items()}  # new weights (same exponents)
    write, calls = D.SpillFile.write, []

    def full(self, tensor):
        calls.append(1)
        if len(calls) == 4:  # the first tensor's fourth row
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, tensor)

    monkeypatch.setattr(D.SpillFile, "write", full)
    with pytest.raises(OSError, match="No space left"):
        model.load_state_dict(state)
    monkeypatch.undo()
    assert used() == before
    ids = torch.arange(40)
    assert same_bits(model(ids), ref(ids))  # the old rows, whole
    model.load_state_dict(state)
    ref.load_state_dict(state)
    assert same_bits(model(ids), ref(ids)) and used() == before


def test_host_budget_in_bytes_is_shared_by_the_layers(tmp_path):
    model, ref = model_pair(layers=3)
    row = sum(p.nbytes for p in ref.blocks[0].experts.parameters()) // E
    moepage.wrap(model, 3, host_budget=f"{5 * 3 * row}B", spill_dir=tmp_path)
    assert [store_of(model).held_rows(layer.name) for layer in moepage.paged_layers(model)] == [5, 5, 5]
    ids = torch.arange(30) % 40
    assert same_bits(model(ids), ref(ids))


@pytest.mark.parametrize("budget", [E, E + 1, "row * E", "1GiB"])
def test_a_budget_that_holds_every_expert_makes_no_disk_tier_and_says_so(tmp_path, budget):
    """H >= E, as rows or as bytes: every expert stays in host memory, no disk tier is made and nothing is written in
    the spill folder; one warning names the option and says so."""
    model, ref = model_pair(layers=3)
    row = sum(p.nbytes for p in ref.blocks[0].experts.parameters()) // E
    budget = f"{3 * row * E}B" if budget == "row * E" else budget
    with pytest.warns(UserWarning) as said:
        moepage.wrap(model, 3, host_budget=budget, spill_dir=tmp_path / "rows")
    assert len(said) == 1 and said[0].filename == __file__
    assert str(said[0].message).startswith(f"moepage.wrap: host_budget={budget!r} holds every expert of each MoE layer "
                                           f"(E={E}")
    assert "no disk tier is needed" in str(said[0].message)
    assert not isinstance(next(moepage.paged_layers(model)).store, TieredStore) and not (tmp_path / "rows").exists()
    ids = torch.arange(30) % 40
    assert same_bits(model(ids), ref(ids))


def test_a_byte_budget_lists_the_layers_below_k_and_how_many_more(tmp_path):
    """A byte budget under K rows in some layers names them (the first three, then how many more), each with its K,
    and says one row in every layer is what a unit of H costs."""
    model, _ = model_pair(layers=5)
    row = sum(p.nbytes for p in model.blocks[0].experts.parameters()) // E
    with pytest.raises(moepage.ConfigError) as info:
        split = {f"blocks.{i}.experts": 2 if i == 0 else 4 for i in range(5)}
        moepage.wrap(model, split, host_budget=f"{3 * 5 * row}B", spill_dir=tmp_path)
    text = str(info.value)
    assert (f"holds 3 expert rows in each of the 5 MoE layers ({row * 5 / 1024:.2f} KiB for one row in every layer), "
            "fewer than the K slots of 4 layers: blocks.1.experts (K=4), blocks.2.experts (K=4), blocks.3.experts "
            "(K=4) and 1 more; raise it to at least") in text


@pytest.mark.parametrize("kwargs,fragments", [
    (dict(host_budget=4), ["spill_dir="]),
    (dict(spill_dir="x"), ["spill_dir='x' is for host_budget="]),
    (dict(host_budget=2, spill_dir="x"), ["host_budget=2 holds 2 expert rows in each MoE layer, fewer than K=3 slots "
                                          "in every layer; raise it to at least K=3"]),
    (dict(host_budget="1KiB", spill_dir="x"), ["holds 0 expert rows in each of the 2 MoE layers (",
                                                " for one row in every layer), fewer than K=3", "raise it to"]),
    (dict(host_budget="lots", spill_dir="x"), ["cannot read a byte size from 'lots'"]),
    (dict(host_budget=-5, spill_dir="x"), ["host_budget=-5: a negative number of host rows; expected host rows per "
                                           "layer (an integer H >= K", "'64GiB'"]),
    (dict(host_budget=0, spill_dir="x"), ["host_budget=0: zero host rows; expected host rows per layer"]),
    (dict(host_budget="-5", spill_dir="x"), ["host_budget='-5': a negative number of host rows; expected"]),
    (dict(host_budget="-5MiB", spill_dir="x"), ["host_budget='-5MiB': a negative byte size; expected host rows per "
                                                "layer", "'64GiB'"]),
    (dict(host_budget="0MiB", spill_dir="x"), ["host_budget='0MiB': zero bytes; expected host rows per layer"]),
    (dict(host_budget=4, spill_dir="x", device_planner=True), ["device_planner=True"]),
    (dict(host_budget=4.0, spill_dir="x"), ["host_budget=4.0 (float): expected host rows per layer", "'64GiB'"]),
    (dict(host_budget={0: 4}, spill_dir="x"), ["host_budget={0: 4} (dict)"]),
    (dict(host_budget=4, spill_dir=""), ["spill_dir='': expected the path of a folder"]),
    (dict(host_budget=4, spill_dir=5), ["spill_dir=5: expected the path of a folder"]),
    (dict(host_budget=4, spill_dir=__file__), ["is a file, not a folder"]),
    (dict(host_budget=4, spill_dir=os.path.join(__file__, "x")), ["is a file, not a folder"]),
    (dict(host_budget=4, spill_dir="x", small_disk=True), ["of expert rows to write there", "free"]),
    (dict(host_budget=4, spill_dir="/proc/x"), ["spill_dir='/proc/x': /proc/x cannot be created"]),
    (dict(host_budget=4, spill_dir="/proc"), ["spill_dir='/proc': nothing can be written in /proc"]),
])
def test_bad_host_budgets_are_refused_before_anything_is_allocated(tmp_path, monkeypatch, kwargs, fragments):
    monkeypatch.chdir(tmp_path)
    if kwargs.pop("small_disk", False):  # every row is written into the folder: their bytes must be free there
        monkeypatch.setattr("shutil.disk_usage", lambda path: SimpleNamespace(total=1 << 30, used=1 << 30, free=100))
    model, ref = model_pair()
    with pytest.raises(moepage.ConfigError) as info:
        moepage.wrap(model, 3, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert not list(moepage.paged_layers(model)) and os.listdir(tmp_path) == []
    assert same_bits(model(torch.arange(5)), ref(torch.arange(5)))


@pytest.mark.parametrize("value,says", [("-5", "a negative number of host rows"), ("0", "zero host rows"),
                                        ("-5MiB", "a negative byte size"), ("0GiB", "zero bytes")])
def test_a_budget_at_or_below_zero_is_refused_as_such_in_the_variable_and_the_engines_flag(tmp_path, monkeypatch,
                                                                                           value, says):
    """The variable and the engines' flag follow the argument's rule: the value itself is refused, with what is
    allowed, not read as a count of rows below K."""
    from moepage.integrations.options import tier_problems

    monkeypatch.setenv("MOEPAGE_HOST_BUDGET", value)
    model, _ = model_pair()
    with pytest.raises(moepage.ConfigError) as info:
        moepage.wrap(model, 3, spill_dir=tmp_path / "rows")
    assert f"MOEPAGE_HOST_BUDGET={value!r} is {says}; expected host rows per layer" in str(info.value)
    assert "fewer than" not in str(info.value) and not list(moepage.paged_layers(model))
    assert tier_problems(value, str(tmp_path)) == [f"--paged-experts-host-budget {value!r}: {says}; expected host "
                                                   f"rows per layer (an integer H >= K; H >= E keeps every expert in "
                                                   "host memory, no disk tier) or a byte size shared by the layers, "
                                                   "e.g. '64GiB'"]


def test_each_variable_stands_for_its_own_argument_and_errors_name_it(tmp_path, monkeypatch):
    """MOEPAGE_SPILL_DIR with host_budget=, MOEPAGE_HOST_BUDGET with spill_dir=; a refusal names the variable."""
    model, ref = model_pair()
    monkeypatch.setenv("MOEPAGE_SPILL_DIR", str(tmp_path / "env"))
    moepage.wrap(model, 3, host_budget=4)
    assert store_of(model).spill_dir == str(tmp_path / "env")
    assert same_bits(model(torch.arange(20)), ref(torch.arange(20)))
    moepage.unwrap(model)
    model, ref = model_pair()
    moepage.wrap(model, 3)  # the folder's variable alone: no disk tier
    assert not isinstance(next(moepage.paged_layers(model)).store, TieredStore)
    moepage.unwrap(model)
    monkeypatch.delenv("MOEPAGE_SPILL_DIR")
    monkeypatch.setenv("MOEPAGE_HOST_BUDGET", "5")
    moepage.wrap(model, 3, spill_dir=tmp_path / "arg")
    assert store_of(model).held_rows(next(moepage.paged_layers(model)).name) == 5
    moepage.unwrap(model)
    monkeypatch.setenv("MOEPAGE_HOST_BUDGET", "2")
    with pytest.raises(moepage.ConfigError, match="MOEPAGE_HOST_BUDGET=2 holds 2 expert rows in each MoE layer, "):
        moepage.wrap(model, 3, spill_dir=tmp_path / "arg")
    monkeypatch.setenv("MOEPAGE_HOST_BUDGET", "4")
    with pytest.raises(moepage.ConfigError, match=r"MOEPAGE_HOST_BUDGET=4 keeps experts on disk.*MOEPAGE_SPILL_DIR"):
        moepage.wrap(model, 3)


def test_a_spill_folder_that_cannot_be_made_is_refused_first_naming_the_variable(tmp_path, monkeypatch):
    """A folder the permissions allow but the file system refuses (/proc, even to root) is refused by wrap's check,
    naming the variable it came by; where it goes bad after the check, making it is a ``ConfigError`` naming it, not
    a bare ``OSError``."""
    from moepage.backends import folder

    model, _ = model_pair()
    monkeypatch.setenv("MOEPAGE_SPILL_DIR", "/proc/x")
    with pytest.raises(moepage.ConfigError, match=r"MOEPAGE_SPILL_DIR='/proc/x': /proc/x cannot be created"):
        moepage.wrap(model, 3, host_budget=4)
    assert not list(moepage.paged_layers(model))
    with pytest.raises(moepage.ConfigError, match=r"spill folder /proc/x: cannot make it"):
        folder.new_file("/proc/x", "rows-")


# -- faults of a disk read --------------------------------------------------------------------------------------------
class Faulty:
    """A ``RowFile`` whose reads fail as ``mode`` says, while ``armed``."""

    armed = False
    mode = "short"

    def __init__(self, path: str):
        self.inner = D.OsFile(path)

    def readinto(self, buf, offset):
        if Faulty.armed and Faulty.mode == "eio":
            raise OSError(errno.EIO, "Input/output error")
        got = self.inner.readinto(buf, offset)
        if Faulty.armed and Faulty.mode == "short":
            return min(got, 3)
        if Faulty.armed and Faulty.mode == "corrupt":
            buf[0] = buf[0] ^ 0xFF
            buf[len(buf) - 1] = buf[len(buf) - 1] ^ 0xFF
        return got

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("mode", ["short", "eio", "corrupt", "changed"])
def test_a_failed_disk_read_names_the_file_and_expert_and_the_next_steps_are_exact(tmp_path, monkeypatch, mode,
                                                                                     compress):
    monkeypatch.setattr(D.DiskRows, "__init__", _with_opener(D.DiskRows.__init__, Faulty))
    model, ref = model_pair(torch.bfloat16, hidden=64) if compress else model_pair()
    moepage.wrap(model, 3, host_budget=4, spill_dir=tmp_path, compress=compress)
    store = store_of(model)
    store.disk.seal()  # the spill files are whole: reads check their identity from now
    rng = random.Random(7)
    warm = prompts(rng, 3)
    for ids in warm:
        model(ids)
    spill = store.files.spills[(next(moepage.paged_layers(model)).name, "gate_up_proj")].path  # a step reads it first
    Faulty.mode = mode
    if mode == "changed":
        os.utime(spill, ns=(0, 0))  # as a rewrite would leave it
    else:
        Faulty.armed = True
    wide = torch.arange(40)  # every expert: some must come from disk
    with pytest.raises(moepage.PageInError) as info:
        model(wide)
    msg = str(info.value)
    assert spill in msg and "expert" in msg
    assert {"short": "short read", "eio": "Input/output error", "corrupt": "checksum mismatch",
            "changed": "changed after its rows were laid out"}[mode] in msg
    Faulty.armed = False
    if mode == "changed":
        pytest.raises(moepage.PageInError, model, wide)  # stale stays stale
        return
    for layer in moepage.paged_layers(model):  # both tiers consistent: resident rows are what they say
        tier = store._layers[layer.name].residency
        for expert in tier.slot_expert:
            if expert >= 0:
                for name in layer.specs:  # (read_row: the host tier's row, decoded where coded)
                    want = ref.get_submodule(layer.name)._parameters[name][expert]
                    assert same_bits(store.read_row(layer.name, name, expert), want)
        layer.check_slots()
    for ids in (wide, *warm):
        assert same_bits(model(ids), ref(ids))


def _with_opener(init, opener):
    def patched(self, opener_=opener):
        init(self, opener_)

    return patched


def test_an_interrupt_while_disk_reads_are_in_flight_waits_for_them_before_the_rows_are_reused(tmp_path, monkeypatch):
    """Ctrl-C right after a fetch issues its reads, before it waits for them: a read still runs in the pool. The next
    steps give its host row to other experts; its late bytes must not land in that row after they filled it."""
    import inspect
    import sys
    import threading
    import time

    from moepage.backends import tiered

    model, ref = model_pair(layers=1)
    moepage.wrap(model, TOP_K, host_budget=E // 2, spill_dir=tmp_path)
    store = store_of(model)
    read, late = store.disk.read, threading.Event()

    def reading(*args):  # the interrupted step's first read lands after the next steps' reads
        if late.is_set():
            late.clear()
            time.sleep(0.5)
        return read(*args)

    monkeypatch.setattr(store.disk, "read", reading)
    source, first = inspect.getsourcelines(tiered.TieredStore._fetch)
    after_submit = first + next(i for i, line in enumerate(source) if "failed: set[int] = set()" in line)
    fired = []

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename == tiered.__file__ else None

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == after_submit and not fired:
            fired.append(True)
            raise KeyboardInterrupt
        return local

    late.set()
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            model(torch.arange(12))
    finally:
        sys.settrace(None)
    assert fired
    rng = random.Random(3)
    for ids in prompts(rng, 6):  # the host rows go to other experts, then the late read would land
        assert same_bits(model(ids), ref(ids)), ids
    time.sleep(0.6)
    (layer, lay), = store._layers.items()
    for h, e in enumerate(lay.residency.slot_expert):  # every held row holds the expert the tier says it holds
        if e >= 0:
            for name, rows in ((n, store.host_tier.held(layer, n)) for n in lay.specs):
                want = torch.empty_like(rows[h])
                read(layer, name, e, want)
                assert same_bits(rows[h], want), (h, e, name)
    for ids in prompts(rng, 6):
        assert same_bits(model(ids), ref(ids)), ids


def test_an_interrupt_inside_the_submission_of_a_read_still_waits_for_it(tmp_path, monkeypatch):
    """Ctrl-C inside ``submit``, after the read is queued and before its future comes back (a thread pool starting a
    thread is such a place): no future to wait on, yet the next steps must wait for that read before reusing its row."""
    import threading
    import time

    model, ref = model_pair(layers=1)
    moepage.wrap(model, TOP_K, host_budget=E // 2, spill_dir=tmp_path)
    store = store_of(model)
    read, submit, late = store.disk.read, store.readers.submit, threading.Event()

    def reading(*args):  # the lost read lands after the next steps' reads, unless they wait for it
        if late.is_set():
            late.clear()
            time.sleep(0.5)
        return read(*args)

    fired: list[bool] = []

    def first_submit_interrupted(fn, *args):
        future = submit(fn, *args)
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt
        return future

    monkeypatch.setattr(store.disk, "read", reading)
    monkeypatch.setattr(store.readers, "submit", first_submit_interrupted)
    late.set()
    with pytest.raises(KeyboardInterrupt):
        model(torch.arange(12))
    assert fired
    rng = random.Random(4)
    for ids in prompts(rng, 8):  # host rows go to other experts while the lost read is still sleeping
        assert same_bits(model(ids), ref(ids)), ids
    time.sleep(0.6)
    for ids in prompts(rng, 8):
        assert same_bits(model(ids), ref(ids)), ids


def test_a_relative_spill_dir_keeps_working_after_the_process_changes_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, ref = model_pair()
    moepage.wrap(model, TOP_K, host_budget=3, spill_dir="rows")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    for ids in prompts(random.Random(5), 4):
        assert same_bits(model(ids), ref(ids)), ids
    moepage.unwrap(model)
    assert rows_in(tmp_path / "rows") == []


def test_a_model_dropped_without_unwrap_leaves_no_rows_on_disk(tmp_path):
    import gc

    model, ref = model_pair()
    moepage.wrap(model, TOP_K, host_budget=3, spill_dir=tmp_path)
    model(torch.arange(12))
    assert len(rows_in(tmp_path)) == 4  # a spill file a tensor of each layer: a copy of every expert
    del model
    gc.collect()
    assert rows_in(tmp_path) == []


def test_unwrap_leaves_the_folder_as_it_found_it_lock_file_included(tmp_path):
    """The rows wrap wrote go at unwrap, and the folder's lock file with them: nothing is left that it guards."""
    model, ref = model_pair()
    moepage.wrap(model, TOP_K, host_budget=4, spill_dir=tmp_path / "rows")
    model(torch.arange(12))
    assert ".lock" in os.listdir(tmp_path / "rows")
    moepage.unwrap(model)
    assert os.listdir(tmp_path / "rows") == []


def test_a_lock_file_held_by_another_process_or_guarding_files_stays(tmp_path):
    """unwrap deletes the lock file only where no process holds it and the folder keeps nothing it guards: another
    process at work in the folder (its lock held) or another's rows keep it."""
    import fcntl

    from moepage.backends import folder

    for other in ("holds the lock", "keeps rows there"):
        rows = tmp_path / other.replace(" ", "-")
        model, _ = model_pair()
        moepage.wrap(model, TOP_K, host_budget=4, spill_dir=rows)
        fd = os.open(rows / ".lock", os.O_WRONLY)  # a lock of its own: flock holds it as another process would
        try:
            if other == "holds the lock":
                fcntl.flock(fd, fcntl.LOCK_EX)
            else:
                (rows / "rows-of-another.moepage").write_bytes(b"x")
            moepage.unwrap(model)
            assert (rows / ".lock").exists() and rows_in(rows) == (["rows-of-another.moepage"] if "rows" in other
                                                                   else [])
        finally:
            os.close(fd)
    folder.unlock(str(tmp_path / "holds-the-lock"))  # let go now: it goes
    assert os.listdir(tmp_path / "holds-the-lock") == []


def test_a_process_waiting_for_a_lock_file_deleted_meanwhile_takes_the_new_one(tmp_path):
    """Deleting the lock file is safe for one waiting on it: once it gets the deleted file's lock, it sees the file
    gone and takes the one at the path (two holding locks of different files would both change the folder)."""
    import threading

    from moepage.backends import folder

    inside = []
    with folder.locked(str(tmp_path)):
        def wait() -> None:
            with folder.locked(str(tmp_path)):
                inside.append((tmp_path / ".lock").exists())

        waiter = threading.Thread(target=wait)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # waiting for the lock this holds
        os.remove(tmp_path / ".lock")  # as ``unlock`` deletes it, holding it
    waiter.join(10)
    assert inside == [True]  # it holds the lock of the file there, made anew


def test_unwrap_succeeds_when_the_spill_file_was_removed_by_hand(tmp_path):
    model, ref = model_pair()
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    # every row in host memory, unwrap needs no read (a store of one's own: a budget of E rows makes no disk tier)
    moepage.wrap(model, TOP_K, backend=TieredStore(tmp_path, lambda layer, e, k: e))
    model(torch.arange(E * 2))
    assert rows_in(tmp_path)
    for name in os.listdir(tmp_path):
        os.remove(tmp_path / name)
    moepage.unwrap(model)
    assert all(same_bits(v, before[k]) for k, v in model.state_dict().items())


# -- a host tier warmed from a routing trace ------------------------------------------------------------------------
HOT = ([6, 7, 5, 1], [2, 0, 4, 3])  # per layer, most routed first


def write_trace(path, hot=HOT, num_experts=E, layers=2, steps=10) -> str:
    """A routing trace (``moepage record``'s format) whose layer l routes HOT[l][i] in 10 - 2i of 10 steps."""
    import numpy as np

    from moepage.planning.traces import save_simple

    ids = np.full((steps, layers, 4), -1, dtype=np.int32)
    for layer in range(layers):
        for i, e in enumerate(hot[layer % len(hot)]):
            ids[: 10 - 2 * i, layer, i] = e
    save_simple(path, ids, num_experts, TOP_K)
    return str(path)


def test_the_host_tier_starts_with_the_experts_a_trace_routes_to_most(tmp_path, monkeypatch):
    """``host_warm=``: each layer's host tier holds the trace's H most routed experts of that layer, read before any
    step and not counted as a step's misses; steps stay exact. ``MOEPAGE_HOST_WARM`` stands for the argument."""
    trace = write_trace(tmp_path / "trace.npz")
    for how in ("argument", "variable"):
        model, ref = model_pair()
        if how == "variable":
            monkeypatch.setenv("MOEPAGE_HOST_WARM", trace)
        moepage.wrap(model, 2, host_budget=3, spill_dir=tmp_path / how, **({"host_warm": trace} if how == "argument"
                                                                            else {}))
        store = store_of(model)
        for layer, hot in zip(moepage.paged_layers(model), HOT):
            tier = store._layers[layer.name].residency
            assert {e for e in range(E) if tier.expert_slot[e] >= 0} == set(hot[:3]), layer.name  # H = 3 of them
        assert moepage.stats(model).total.host_misses == 0 and moepage.stats(model).total.disk_bytes == 0
        rng = random.Random(3)
        for ids in prompts(rng, 6):
            assert same_bits(model(ids), ref(ids))
        moepage.unwrap(model)
        monkeypatch.delenv("MOEPAGE_HOST_WARM", raising=False)


@pytest.mark.parametrize("make, kwargs, says", [
    (None, dict(host_warm="t.npz"), "host_warm='t.npz' is for host_budget="),
    (None, dict(host_budget=4, spill_dir="x", host_warm="missing.npz"), "missing.npz"),
    (dict(num_experts=16), dict(host_budget=4, spill_dir="x"), "its routing is over E=16 experts"),
    (dict(layers=1), dict(host_budget=4, spill_dir="x"), "MoE layer 1 (blocks.1.experts): it has 1 MoE layers"),
    (dict(steps=0), dict(host_budget=4, spill_dir="x"), "the trace has no steps"),
    (None, dict(host_budget=4, spill_dir="x", host_warm=5), "expected the path of a routing trace"),
])
def test_a_warm_trace_that_cannot_serve_is_refused_before_anything_is_allocated(tmp_path, monkeypatch, make, kwargs,
                                                                               says):
    monkeypatch.chdir(tmp_path)
    if make is not None:
        kwargs["host_warm"] = write_trace(tmp_path / "t.npz", **make)
    model, ref = model_pair()
    with pytest.raises(moepage.ConfigError, match="host_warm=") as info:
        moepage.wrap(model, 3, **kwargs)
    assert says in str(info.value)
    assert not list(moepage.paged_layers(model)) and [n for n in os.listdir(tmp_path) if n != "t.npz"] == []


def test_warming_reads_the_first_h_experts_and_counts_no_miss(tmp_path):
    from moepage.backends.protocol import RowSpec

    store = TieredStore(tmp_path, lambda layer, e, k: 3)
    store.allocate("l", {"w": RowSpec((4,), torch.float32)}, E, 2, torch.device("cpu"))
    rows = torch.arange(E * 4, dtype=torch.float32).view(E, 4)
    store.write_rows("l", "w", rows)
    assert store.warm("l", [5, 3, 5, 1, 0]) == 3  # 5, 3, 1: the first H distinct
    assert vars(store.tier_stats("l")) == vars(type(store.tier_stats("l"))())
    store.page_in("l", [(5, 0), (1, 1)])
    stats = store.tier_stats("l")
    assert stats.host_hits == 2 and stats.host_misses == 0 and stats.disk_bytes == 0
    assert torch.equal(store.slots("l", "w"), rows[[5, 1]])
    with pytest.raises(moepage.ConfigError, match="outside 0..7"):
        store.warm("l", [8])
    store.close()


def test_a_warm_trace_is_read_as_it_is_where_the_path_names_it_now(tmp_path, monkeypatch):
    """The trace a path names after a chdir, or in a folder whose file was rewritten, or an npy trace that never
    routes the top expert ids (E is the model's): each read as it is now. Wrapping one experts module of a model
    whose trace has more layers says which of them it takes."""
    import numpy as np

    def hosted(model):
        store, layer = store_of(model), next(moepage.paged_layers(model))
        tier = store._layers[layer.name].residency
        return {e for e in range(E) if tier.expert_slot[e] >= 0}

    for name, hot in (("a", ([0, 1, 2], [0, 1, 2])), ("b", ([5, 6, 7], [5, 6, 7]))):
        (tmp_path / name).mkdir()
        write_trace(tmp_path / name / "trace.npz", hot=hot)
        os.utime(tmp_path / name / "trace.npz", ns=(10**9, 10**9))  # the same size and time in both folders
    for name, want in (("a", {0, 1, 2}), ("b", {5, 6, 7})):
        monkeypatch.chdir(tmp_path / name)
        model, _ = model_pair()
        moepage.wrap(model, 2, host_budget=3, spill_dir=tmp_path / "rows", host_warm="trace.npz")
        assert hosted(model) == want, name
        moepage.unwrap(model)
    folder = tmp_path / "dir"
    folder.mkdir()
    for hot, want in ((([0, 1, 2], [0, 1, 2]), {0, 1, 2}), (([3, 4, 5], [3, 4, 5]), {3, 4, 5})):
        write_trace(folder / "t.npz", hot=hot)  # rewritten in place: the folder's own identity may not move
        model, _ = model_pair()
        moepage.wrap(model, 2, host_budget=3, spill_dir=tmp_path / "rows", host_warm=folder)
        assert hosted(model) == want
        moepage.unwrap(model)
    np.save(tmp_path / "t.npy", np.array([[[0, 1], [2, 3]]] * 6, dtype=np.int32))  # ids < 7: E is the model's
    model, ref = model_pair()
    moepage.wrap(model, 2, host_budget=3, spill_dir=tmp_path / "rows", host_warm=tmp_path / "t.npy")
    assert hosted(model) == {0, 1}
    moepage.unwrap(model)
    model, ref = model_pair()
    with pytest.warns(UserWarning, match="has 2 MoE layers, this call pages 1"):
        moepage.wrap(model.blocks[1].experts, 2, host_budget=3, spill_dir=tmp_path / "rows",
                     host_warm=write_trace(tmp_path / "t2.npz"))


def test_a_home_relative_folder_and_trace_are_the_homes_not_a_folder_named_tilde(tmp_path, monkeypatch):
    """``spill_dir="~/rows"`` (the argument, ``MOEPAGE_SPILL_DIR``, the engines' option) and ``host_warm="~/..."``
    name the home's, as a shell would read them: no folder named ``~`` is made where the process runs."""
    from moepage.integrations import options

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    write_trace(home / "trace.npz")
    model, ref = model_pair()
    moepage.wrap(model, 2, host_budget=3, spill_dir="~/rows", host_warm="~/trace.npz")
    assert store_of(model).spill_dir == str(home / "rows")
    assert same_bits(model(torch.arange(20)), ref(torch.arange(20)))
    moepage.unwrap(model)
    monkeypatch.setenv("MOEPAGE_SPILL_DIR", "~/env")
    moepage.wrap(model, 2, host_budget=3)
    assert store_of(model).spill_dir == str(home / "env")
    moepage.unwrap(model)
    tier = options.disk_tier(3, "~/engine", "lru", lambda: (None, None), "sglang")
    assert tier is not None and tier.spill_dir == str(home / "engine")
    assert os.listdir(work) == []


def test_a_file_changed_after_its_rows_were_laid_out_says_which_of_its_identity_moved(tmp_path):
    """Only the change time moved (a chmod, a rewrite that put the modification time back): the error says that, not
    a size, mtime or inode that did not change."""
    import time

    from moepage.backends import folder

    rows = D.DiskRows()
    spill = D.SpillFile.new(str(tmp_path))
    rows.declare("l", "w", 1)
    rows.put("l", "w", 0, 0, 1, spill.write(torch.arange(8.0)))
    spill.close()
    rows.seal()
    time.sleep(0.05)  # past the clock's tick: the change time moves
    os.chmod(spill.path, os.stat(spill.path).st_mode)
    with pytest.raises(moepage.PageInError) as info:
        rows.read("l", "w", 0, torch.empty(8))
    msg = str(info.value)
    assert "its change time (ctime_ns): " in msg and " then, " in msg
    assert "size" not in msg and "modification" not in msg and "inode" not in msg
    folder.release(spill.path)
