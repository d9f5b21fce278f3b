"""The ``moepage`` command as users meet it: on a base install (no numpy, no safetensors), and
with bad input, where every error is one line on stderr naming the file or flag, exit status 2."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import moepage
from moepage import cli

ROOT = Path(__file__).resolve().parents[2]


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], int]], cut: int = 0) -> Path:
    """A safetensors file written by hand (``{name: (dtype, shape, nbytes)}``, zero data), less
    its last ``cut`` bytes."""
    header, offset = {}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    data = struct.pack("<Q", len(raw)) + raw + bytes(offset)
    path.write_bytes(data[: len(data) - cut])
    return path


def tiny_checkpoint(path: Path, cut: int = 0) -> Path:
    path.mkdir(exist_ok=True)
    tensors = {f"model.layers.{l}.mlp.experts.{e}.{n}.weight": ("BF16", [8, 16], 256)
               for l in range(2) for e in range(4) for n in ("gate_proj", "up_proj", "down_proj")}
    tensors["model.embed_tokens.weight"] = ("BF16", [32, 16], 1024)
    write_safetensors(path / "model.safetensors", tensors, cut)
    (path / "config.json").write_text(json.dumps({"num_experts": 4, "num_experts_per_tok": 2}))
    return path


def fails(capsys, *argv: str, fragments: tuple[str, ...]) -> str:
    """``moepage argv`` exits 2 with one line on stderr holding every fragment, and prints nothing."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert out == "" and err.count("\n") == 1 and err.startswith(f"moepage {argv[0]}: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


# -- a base install -----------------------------------------------------------------------------
_CHILD = """
import contextlib, io, json, sys

class Blocker:  # as if these were not installed
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Blocker())
from moepage.cli import main

results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    results.append([code, out.getvalue(), err.getvalue()])
results.append(sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED | {"moepage"}))
print(json.dumps(results))
"""


def test_cli_works_without_numpy_or_safetensors(tmp_path):
    blocked = {"numpy", "safetensors", "matplotlib", "transformers"}
    runs = [["--help"], ["--version"], ["plan", str(tiny_checkpoint(tmp_path / "ckpt")), "--gpu-mem", "1MiB"],
            ["trace", "x.npz"], ["synth", "x.npz"]]
    child = subprocess.run([sys.executable, "-c", f"BLOCKED = {blocked!r}\n" + _CHILD, json.dumps(runs)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    (help_, version, plan, trace, synth, modules) = json.loads(child.stdout.splitlines()[-1])
    assert help_[0] == 0 and "{trace,synth,plan,record}" in help_[1]
    assert version[:2] == [0, f"moepage {moepage.__version__}\n"]
    assert plan[0] == 0 and "feasible K: 2..4" in plan[1], plan
    assert trace == [2, "", 'moepage trace: needs numpy: pip install "moepage[traces]"\n']
    assert synth == [2, "", 'moepage synth: needs numpy: pip install "moepage[traces]"\n']
    assert not [m for m in modules if m.partition(".")[0] in blocked], modules  # nothing half-imported
    assert "moepage.planning.traces" not in modules and "moepage.planning.synthetic" not in modules


def test_png_without_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch):
    import numpy as np

    from moepage.planning import traces

    traces.save_simple(tmp_path / "t.npz", np.zeros((4, 1, 1), dtype=np.int64), 4, 1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    assert cli.main(["trace", str(tmp_path / "t.npz"), "--png", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err == 'moepage trace: --png needs matplotlib: pip install "moepage[traces]"\n'


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"moepage {moepage.__version__}\n"


# -- plan ----------------------------------------------------------------------------------------
def test_plan_on_a_six_byte_file(tmp_path, capsys):
    (tmp_path / "six.safetensors").write_bytes(b"abcdef")
    fails(capsys, "plan", str(tmp_path / "six.safetensors"), "--gpu-mem", "1GiB",
          fragments=(str(tmp_path / "six.safetensors"), "6 bytes, too short for a safetensors file"))


def test_plan_on_a_truncated_file(tmp_path, capsys):
    path = tiny_checkpoint(tmp_path / "ckpt", cut=100)
    fails(capsys, "plan", str(path), "--gpu-mem", "1GiB",
          fragments=(str(path / "model.safetensors"), "truncated or corrupt", "download or save it again"))


def test_plan_on_a_header_that_is_not_json(tmp_path, capsys):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"{no}")
    fails(capsys, "plan", str(path), "--gpu-mem", "1GiB", fragments=(str(path), "not a safetensors header"))


def test_plan_on_a_trace_says_it_goes_with_trace(tmp_path, capsys):
    path = tmp_path / "t.npz"
    path.write_bytes(b"PK" + bytes(64))  # a trace given where the checkpoint goes
    fails(capsys, "plan", str(path), "--gpu-mem", "1GiB", fragments=(str(path), "a routing trace", "--trace"))


def test_plan_on_no_such_path(tmp_path, capsys):
    fails(capsys, "plan", str(tmp_path / "nothing"), "--gpu-mem", "1GiB",
          fragments=(str(tmp_path / "nothing"), "no such file or directory"))


@pytest.mark.parametrize("flags,bad", [(["--gpu-mem", "16"], "--gpu-mem"),
                                       (["--gpu-mem", "16GiB", "--reserve", "4"], "--reserve")])
def test_plan_byte_sizes_need_a_unit(tmp_path, capsys, flags, bad):
    """``--gpu-mem 16`` was read as 16 bytes."""
    value = flags[flags.index(bad) + 1]
    fails(capsys, "plan", str(tiny_checkpoint(tmp_path / "ckpt")), *flags,
          fragments=(f"argument {bad}", f"cannot read a byte size from '{value}'", "16GiB"))


def test_plan_checks_every_k_before_printing(tmp_path, capsys):
    fails(capsys, "plan", str(tiny_checkpoint(tmp_path / "ckpt")), "--gpu-mem", "1GiB", "--k", "2,100",
          fragments=("--k 2,100", "K=100", "outside top_k=2..num_experts=4"))


@pytest.mark.parametrize("k,said", [("1,3", "K=1 is below top_k=2"), ("0.1", "K=1 is below top_k=2"),
                                    ("2,9", "K=9 is outside")])
def test_trace_and_plan_refuse_the_same_k_outside_top_k_to_e(tmp_path, capsys, k, said):
    """One K rule for ``trace`` and ``plan`` (``resolve_k``): a K below top_k is refused, as a K above E is, with the
    range top_k..E (it was skipped by ``trace``, leaving an empty table and status 0)."""
    import numpy as np

    from moepage.planning import traces

    trace = tmp_path / "t.npz"
    traces.save_simple(trace, np.array([[[0, 1]], [[2, 3]], [[4, 5]]]), num_experts=8, top_k=2)
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    rule = (said, "outside top_k=2..") + (("0.1 of E=8 is K=1",) if "." in k else ())
    fails(capsys, "trace", str(trace), "--k", k, "--policies", "lru",
          fragments=(f"--k {k}: ", *rule, "..num_experts=8"))
    fails(capsys, "trace", str(trace), str(trace), "--k", k, fragments=(f"--k {k} ({trace}): ", *rule))
    if "." not in k:  # the checkpoint has E = 4
        fails(capsys, "plan", str(ckpt), "--gpu-mem", "1GiB", "--k", k, fragments=(f"--k {k}: ", *rule))


def test_trace_s_default_k_is_at_least_top_k(tmp_path, capsys):
    """Without ``--k``: K = E/4, E/2, 3E/4, each raised to top_k (E/4 = 1 is below top_k = 2 here)."""
    import numpy as np

    from moepage.planning import traces

    traces.save_simple(tmp_path / "t.npz", np.array([[[0, 1]], [[2, 3]], [[1, 2]]]), num_experts=4, top_k=2)
    assert cli.main(["trace", str(tmp_path / "t.npz"), "--policies", "lru"]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == ["2", "3"], rows


# -- trace and synth -----------------------------------------------------------------------------
def test_trace_bad_policy_and_k(tmp_path, capsys):
    import numpy as np

    from moepage.planning import traces

    traces.save_simple(tmp_path / "t.npz", np.zeros((4, 1, 1), dtype=np.int64), 4, 1)
    fails(capsys, "trace", str(tmp_path / "t.npz"), "--policies", "lru,lfru:x",
          fragments=("argument --policies", "'lfru:x'"))
    fails(capsys, "trace", str(tmp_path / "t.npz"), "--k", "two", fragments=("--k two", "'two'"))


def test_synth_with_a_calibration_of_another_layout(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"prompts": {}}))
    fails(capsys, "synth", str(tmp_path / "s.npz"), "--calibration", str(path),
          fragments=(str(path), "not an aggregates JSON", "KeyError: 'layers'"))


@pytest.mark.parametrize("flag,value", [("--locality", "2"), ("--tokens", "0"), ("--tokens", "many")])
def test_synth_flags_out_of_range(tmp_path, capsys, flag, value):
    fails(capsys, "synth", str(tmp_path / "s.npz"), flag, value, fragments=(f"argument {flag}", repr(value)))


# -- flags named in every error, outputs checked before the work ----------------------------------
def test_budget_jobs_and_policy_errors_name_their_flag(tmp_path, capsys, monkeypatch):
    """Each said before any replay (the miss curves take minutes on a real trace)."""
    import numpy as np

    from moepage.planning import budgets, traces

    traces.save_simple(tmp_path / "t.npz", np.zeros((4, 2, 1), dtype=np.int64), 4, 1)
    monkeypatch.setattr(budgets, "miss_curves", lambda *a, **k: pytest.fail("replayed before checking"))
    plan = ("plan", "--trace", str(tmp_path / "t.npz"))
    fails(capsys, *plan, "--budget", "abc",
          fragments=("--budget abc: ", "neither a total slot count", "nor a K/E fraction"))
    fails(capsys, *plan, "--budget", "9", fragments=("--budget 9: budget 9 is outside 2..8 (2 layers, K from 1 to 4)",))
    fails(capsys, *plan, "--budget", "4", "--jobs", "0", fragments=("argument --jobs: '0' is not a whole number >= 1",))
    fails(capsys, *plan, "--budget", "4", "--policy", "lfu:x", fragments=("argument --policy: ", "'lfu:x'"))


@pytest.mark.parametrize("argv,flag", [
    (["trace", "{missing}", "--png", "{out}"], "--png"),
    (["plan", "--trace", "{missing}", "--budget", "4", "--out", "{out}"], "--out"),
    (["synth", "{out}"], "OUT"),
])
@pytest.mark.parametrize("where,why", [("nodir/x.out", "directory '{tmp}/nodir' does not exist"),
                                       ("", "is a directory; give a file path")])
def test_output_paths_are_checked_before_the_work(tmp_path, capsys, argv, flag, where, why):
    """The trace to read does not exist: the error is the output's, so it came before any reading."""
    out = str(tmp_path / where) if where else str(tmp_path)
    argv = [a.format(missing=str(tmp_path / "missing.npz"), out=out) for a in argv]
    fails(capsys, *argv, fragments=(f"argument {flag}: '{out}", why.format(tmp=tmp_path)))


def test_synth_writes_exactly_the_path_it_names(tmp_path, capsys):
    import numpy as np

    out = tmp_path / "t.txt"
    assert cli.main(["synth", str(out), "--tokens", "5", "--uniform", "--layers", "2", "--experts", "8",
                     "--top-k", "2"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}: ids [5, 2, 2]")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]  # numpy alone wrote t.txt.npz
    with np.load(out) as data:
        assert data["ids"].shape == (5, 2, 2) and int(data["num_experts"]) == 8


# -- progress ------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,bar", [
    (["trace", "{trace}", "--k", "2,3", "--policies", "lru,lfu"], "moepage: replaying"),
    (["plan", "--trace", "{trace}", "--budget", "6", "--jobs", "1"], "moepage: miss curves of"),
    (["synth", "{out}", "--tokens", "30", "--uniform", "--layers", "2", "--experts", "8", "--top-k", "2"],
     "moepage: generating"),
])
def test_progress_on_stderr_when_forced_and_off_a_terminal_not(tmp_path, capsys, monkeypatch, argv, bar):
    import numpy as np

    from moepage.planning import traces

    trace = tmp_path / "t.npz"
    rng = np.random.default_rng(0)
    traces.save_simple(trace, rng.integers(0, 4, (20, 2, 2)), 4, 2)
    argv = [a.format(trace=trace, out=tmp_path / "s.npz") for a in argv]
    assert cli.main(argv) == 0
    first_out, err = capsys.readouterr()
    assert err == ""  # stderr is no terminal here: no bar unless forced
    assert cli.main([*argv, "--progress"]) == 0
    out, err = capsys.readouterr()
    assert bar in err and "100%" in err and out == first_out
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed: no bar, no error
    assert cli.main([*argv, "--progress"]) == 0
    assert capsys.readouterr() == (first_out, "")


def test_help_is_plain_text(capsys):
    for argv in ([], ["trace"], ["synth"], ["plan"]):
        with pytest.raises(SystemExit):
            cli.main([*argv, "--help"])
        out = capsys.readouterr().out
        assert "usage: moepage" in out and "``" not in out, out


def test_no_numpy_warning_on_a_base_install():
    """torch warns "Failed to initialize NumPy" at import when numpy is missing; moepage silences exactly that."""
    block = ("import sys\nclass Blocker:\n    def find_spec(self, name, path=None, target=None):\n"
             "        if name.partition('.')[0] == 'numpy':\n"
             "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
             "sys.meta_path.insert(0, Blocker())\n")
    runs = {"torch": "import torch", "moepage": "from moepage.cli import main\nmain(['--help'])"}
    err = {}
    for name, code in runs.items():
        child = subprocess.run([sys.executable, "-c", block + code], cwd=ROOT, capture_output=True, text=True,
                               timeout=300)
        err[name] = child.stderr
    assert "Failed to initialize NumPy" in err["torch"]  # what this test guards against is still there
    assert err["moepage"] == ""


def test_a_missing_plotter_is_said_before_the_replays(tmp_path, capsys, monkeypatch):
    import numpy as np

    from moepage.planning import traces

    traces.save_simple(tmp_path / "t.npz", np.zeros((4, 1, 1), dtype=np.int64), 4, 1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(traces, "replay_grid", lambda *a, **k: pytest.fail("replayed before checking matplotlib"))
    fails(capsys, "trace", str(tmp_path / "t.npz"), "--png", str(tmp_path / "p.png"),
          fragments=('--png needs matplotlib: pip install "moepage[traces]"',))


# -- what a new user met: a file that is no trace, a checkpoint beside --trace, a directory without a tokenizer ------
@pytest.mark.parametrize("command", [("plan", "--budget", "0.5", "--trace"), ("trace",)])
@pytest.mark.parametrize("name,content,why", [
    ("notes.npz", "some notes\n", "not a numpy .npz file"),  # numpy blamed "pickled data"
    ("notes.npy", "some notes\n", "not a numpy .npy file"),
    ("empty.npz", "", "not a numpy .npz file"),
    ("aggregates.json", '{"model": "x", "layers": []}', "KeyError: 'prompts'"),
    ("notes.txt", "some notes\n", "unknown suffix '.txt'"),
])
def test_a_file_that_is_no_trace_names_it_and_the_formats(tmp_path, capsys, command, name, content, why):
    from moepage.planning import traces

    path = tmp_path / name
    path.write_text(content)
    err = fails(capsys, *command, str(path), fragments=(f"{path}: not a trace moepage reads ({why}); trace formats, "
                                                        "by suffix: .json: prompts JSON trace",))
    formats = "; ".join(f"{suffix}: {layout}" for suffix, layout in traces.LAYOUTS.items())
    assert err.endswith(f"{formats} (see moepage.planning.traces)\n"), err
    assert "pickle" not in err


def split_trace(path: Path, layers: int, experts: int, top_k: int) -> Path:
    import numpy as np

    from moepage.planning import traces

    ids = np.random.default_rng(0).integers(0, experts, (12, layers, top_k))
    traces.save_simple(path, ids, experts, top_k)
    return path


@pytest.mark.parametrize("layers,experts,top_k,said", [
    (3, 4, 2, "3 MoE layers, E=4, top_k=2"),
    (2, 8, 2, "2 MoE layers, E=8, top_k=2"),
    (2, 4, 1, "2 MoE layers, E=4, top_k=1"),
])
def test_plan_checks_the_trace_against_the_checkpoint(tmp_path, capsys, monkeypatch, layers, experts, top_k, said):
    """``plan CKPT --trace T`` read only T: a trace of another model was split as if it were this one's."""
    from moepage.planning import budgets

    ckpt, trace = tiny_checkpoint(tmp_path / "ckpt"), split_trace(tmp_path / "t.npz", layers, experts, top_k)
    monkeypatch.setattr(budgets, "miss_curves", lambda *a, **k: pytest.fail("replayed before checking"))
    fails(capsys, "plan", str(ckpt), "--trace", str(trace), "--budget", "4",
          fragments=(f"--trace {trace}: {said}, but checkpoint {ckpt} has 2 MoE layers, E=4, top_k=2; "
                     "a split is for the model the trace was recorded on (moepage record CHECKPOINT_DIR)",))


def test_plan_with_a_checkpoint_and_its_trace_prints_the_splits_device_bytes(tmp_path, capsys):
    ckpt, trace = tiny_checkpoint(tmp_path / "ckpt"), split_trace(tmp_path / "t.npz", 2, 4, 2)
    assert cli.main(["plan", str(ckpt), "--trace", str(trace), "--budget", "6", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 layers, E=4, top_k=2, policy" in out and "budget 6 slots" in out, out
    # the tiny checkpoint: 768 bytes an expert in each layer, 1024 dense; 6 slots: 6 * 768 + 1024 = 5632
    assert out.endswith(f"weights on device with this split ({ckpt}): 5.50 KiB (dense 1.00 KiB + 6 slots 4.50 KiB)\n")


def test_the_checkpoint_gives_e_where_the_trace_does_not(tmp_path, capsys):
    """An npy trace has no E: alone it is max id + 1 (3 here, expert 3 never routed); the checkpoint says 4."""
    import numpy as np

    np.save(tmp_path / "t.npy", np.tile([[[0, 1], [1, 2]]], (6, 1, 1)))
    assert cli.main(["plan", str(tiny_checkpoint(tmp_path / "ckpt")), "--trace", str(tmp_path / "t.npy"),
                     "--budget", "0.75", "--jobs", "1"]) == 0
    head = f"{tmp_path.name}/t: 2 layers, E=4, top_k=2, policy lfu, budget 6 slots (mean K 3.0)\n"
    assert capsys.readouterr().out.startswith(head)


def test_record_text_prompts_on_a_checkpoint_without_a_tokenizer(tmp_path, capsys, monkeypatch):
    """It said "no usable tokenizer ... (its vocabulary has 1 entries)": transformers builds an empty tokenizer for a
    directory without tokenizer files."""
    import transformers  # the [test] extra installs it

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model was loaded"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "vocab_size": 96}))
    (tmp_path / "p.txt").write_text("a prompt\n")
    err = fails(capsys, "record", str(ckpt), "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "t.npz"),
                fragments=(f"{ckpt}: no usable tokenizer for text prompts: the checkpoint directory has no tokenizer "
                           "files (tokenizer.json, tokenizer_config.json, vocab.*, *.model); "
                           "give token ids instead (--token-ids FILE)",))
    assert "vocabulary" not in err
    assert not (tmp_path / "t.npz").exists()


# -- the host and disk tiers ----------------------------------------------------------------------------------
def test_plan_prints_the_host_tier_and_the_disk_reads_a_trace_expects(tmp_path, capsys):
    """Below all experts' bytes of host memory, ``plan`` gives H (host rows a layer, ``host_budget=``), what stays on
    disk, the free space at ``--spill-dir``, and the disk reads a trace expects at the recommended K and H; the reads
    are those of ``traces.replay(host_slots=H)``."""
    from moepage.planning import traces

    ckpt, trace = tiny_checkpoint(tmp_path / "ckpt"), split_trace(tmp_path / "t.npz", 2, 4, 2)
    slot = 2 * 3 * 256  # one expert in each of the 2 layers: gate, up, down of 256 bytes
    gpu = 1024 + 2 * slot  # the embedding and two slots: K = 2 is recommended
    assert cli.main(["plan", str(ckpt), "--gpu-mem", f"{gpu}B", "--host-mem", f"{3 * slot}B",
                     "--spill-dir", str(tmp_path), "--traffic", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "recommended: K = 2" in out and "host tier: H = 3 of 4 rows per layer" in out and "host_budget=3" in out
    assert f"--paged-experts-host-budget 3 --paged-experts-spill-dir {tmp_path})" in out  # the serving flags too
    assert f"spill_dir={str(tmp_path)!r}" in out  # the folder given, not a placeholder
    assert f"free in {tmp_path}" in out
    loaded = traces.load_trace(trace, num_experts=4)
    reads = traces.replay(loaded, 2, "lfu", host_slots=3).host_misses
    assert reads > 0 and f"expected disk reads ({loaded.name}, lfu, K = 2, H = 3): {reads} rows over 12 steps" in out
    warmed = traces.replay(loaded, 2, "lfu", host_slots=3, host_warm=loaded).host_misses
    assert warmed < reads and f"{warmed} rows, " in out  # the trace can warm the tier: fewer reads
    assert f"host_warm={str(trace)!r} (serving: --paged-experts-host-warm {trace})" in out
    assert cli.main(["plan", str(ckpt), "--gpu-mem", "1MiB", "--host-mem", "1MiB"]) == 0
    assert "all 4 experts fit in 1.00 MiB of host memory: no disk tier needed" in capsys.readouterr().out
    # a trace of another model is said, not replayed; a folder holding the trace is read as the file is
    for other, why in ((split_trace(tmp_path / "e8.npz", 2, 8, 2), "its routing is over E=8 experts, not 4"),
                       (split_trace(tmp_path / "one.npz", 1, 4, 2), "it has 1 MoE layers, fewer than 2")):
        assert cli.main(["plan", str(ckpt), "--gpu-mem", f"{gpu}B", "--host-mem", f"{3 * slot}B",
                         "--traffic", str(other)]) == 0
        out = capsys.readouterr().out
        assert f"--traffic {other}: {why}" in out and "expected disk reads" not in out and "host_warm=" not in out
    (tmp_path / "folder").mkdir()
    os.replace(trace, tmp_path / "folder" / "t.npz")
    assert cli.main(["plan", str(ckpt), "--gpu-mem", f"{gpu}B", "--host-mem", f"{3 * slot}B",
                     "--traffic", str(tmp_path / "folder")]) == 0
    assert f"{reads} rows over 12 steps" in capsys.readouterr().out


def test_replay_counts_the_host_tier_s_misses_as_the_store_does(tmp_path):
    """``replay(host_slots=H)`` against ``backends.tiered``: the same routing through a real disk tier reads as many
    rows from disk as the replay counts host misses."""
    import numpy as np
    import torch

    import moepage
    from moepage.planning import traces
    from moepage.toy import ToyExperts

    rng = torch.Generator().manual_seed(3)
    steps = [torch.randperm(8, generator=rng)[:2].tolist() for _ in range(40)]
    module = ToyExperts(8, 16, 8, 2)
    moepage.wrap(module, 3, host_budget=5, spill_dir=tmp_path, policy="lru", name="layer")
    for experts in steps:
        module(torch.randn(1, 16), torch.tensor([experts]), torch.full((1, 2), 0.5))
    trace = traces.from_steps("t", [np.array([s]) for s in steps], num_experts=8, top_k=2)
    want = traces.replay(trace, 3, "lru", warm=True, host_slots=5).host_misses
    assert moepage.stats(module)["layer"].host_misses == want > 0


def test_plan_checks_the_disk_tier_flags_and_bounds_k_by_the_host_tier(tmp_path, capsys):
    """``--spill-dir`` that is a file, ``--traffic`` that is no file: one line, status 2, before any figure. Host
    memory for fewer rows than the GPU's K: K = H is what a disk tier can take; ``--host-mem`` is what the host
    line compares with."""
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    slot = 2 * 3 * 256
    (tmp_path / "file").write_text("x")
    fails(capsys, "plan", str(ckpt), "--gpu-mem", "1MiB", "--spill-dir", str(tmp_path / "file"),
          fragments=(f"--spill-dir {tmp_path / 'file'}: {tmp_path / 'file'} is a file, not a folder",))
    fails(capsys, "plan", str(ckpt), "--gpu-mem", "1MiB", "--host-mem", f"{3 * slot}B", "--traffic",
          str(tmp_path / "none.npz"), fragments=(f"--traffic {tmp_path / 'none.npz'}: no such file",))
    assert cli.main(["plan", str(ckpt), "--gpu-mem", "1MiB", "--host-mem", f"{3 * slot}B", "--spill-dir",
                     str(tmp_path / "new" / "rows")]) == 0
    out = capsys.readouterr().out
    assert "host memory given: 4.50 KiB (--host-mem): does NOT fit" in out  # 3 slots, not this machine's memory
    assert "recommended: K = 3 (the largest K leaving the 0 B reserve, at most the host tier's H = 3 rows" in out
    assert f"(resident=3, host_budget=3, spill_dir={str(tmp_path / 'new' / 'rows')!r}" in out
    assert "host_budget=4" not in out
    assert f"free in {tmp_path / 'new' / 'rows'} (made at load: the free space of {tmp_path})" in out


def test_plan_recommends_one_k_that_the_host_tier_holds(tmp_path, capsys):
    """A GPU with room for K = 4 and host memory for H = 3 rows a layer: one recommendation, K = 3 (a disk tier takes
    K <= H), the same K in the disk-tier advice, the serving flags and the table, whose K above H says so; host memory
    for fewer rows than top_k is infeasible (status 1), and memory for every row needs no disk tier (K from the GPU)."""
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    slot = 2 * 3 * 256
    assert cli.main(["plan", str(ckpt), "--gpu-mem", "1MiB", "--host-mem", f"{3 * slot}B"]) == 0
    out = capsys.readouterr().out
    assert out.count("recommended") == 2 and "recommended: K = 3 (" in out  # the line and the table's mark
    assert "--paged-experts-num-resident 3 --paged-experts-host-budget 3 --paged-experts-spill-dir DIR" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("      ")}
    assert rows["3"].endswith("<- recommended") and rows["4"].endswith("(above H = 3 host rows)")
    assert cli.main(["plan", str(ckpt), "--gpu-mem", "1MiB", "--host-mem", f"{slot}B"]) == 1
    assert "infeasible: 1.50 KiB of host memory (--host-mem) holds 1 rows per layer, fewer than top_k = 2" in \
        capsys.readouterr().out
    assert cli.main(["plan", str(ckpt), "--gpu-mem", "1MiB", "--host-mem", f"{4 * slot}B"]) == 0
    out = capsys.readouterr().out
    assert "recommended: K = 4 (the largest K leaving the 0 B reserve;" in out and "no disk tier needed" in out


def test_plan_s_feasible_k_is_at_most_the_host_tier_s_h(tmp_path, capsys):
    """The GPU holds K = 4, host memory H = 3 rows a layer: the feasible range stops at H (a disk tier takes K <= H),
    as the recommendation does."""
    slot = 2 * 3 * 256
    assert cli.main(["plan", str(tiny_checkpoint(tmp_path / "ckpt")), "--gpu-mem", "1MiB", "--host-mem",
                     f"{3 * slot}B"]) == 0
    out = capsys.readouterr().out
    assert "feasible K: 2..3 (K/E 0.500..0.750, at most the host tier's H = 3 rows)\n" in out, out


@pytest.mark.parametrize("flags,said", [(["--gpu-mem", "2KiB"], "infeasible: K = 2 needs 4.00 KiB"),
                                        (["--gpu-mem", "1MiB", "--host-mem", "1536B"],
                                         "infeasible: 1.50 KiB of host memory (--host-mem) holds 1 rows per layer")])
def test_plan_an_infeasible_plan_exits_1_and_prints_no_feasible_k(tmp_path, capsys, flags, said):
    """GPU memory short of top_k slots, or host memory short of top_k rows (even with a disk tier): one status, and
    no feasible K range printed before the verdict that contradicts it."""
    assert cli.main(["plan", str(tiny_checkpoint(tmp_path / "ckpt")), *flags]) == 1
    out = capsys.readouterr().out
    assert said in out and "feasible K" not in out and "recommended" not in out, out


def test_plan_warns_where_the_spill_folder_lacks_room_for_rows_a_load_writes(tmp_path, capsys, monkeypatch):
    """``--spill-dir`` is checked as ``from_pretrained`` checks it (``folder_problem``): a folder without room for
    every row a transformed checkpoint writes is a warning (an unquantized one is read in place, needing none)."""
    from types import SimpleNamespace

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    monkeypatch.setattr("shutil.disk_usage", lambda path: SimpleNamespace(total=1 << 30, used=1 << 30, free=100))
    assert cli.main(["plan", str(ckpt), "--gpu-mem", "1MiB", "--host-mem", "4608B", "--spill-dir",
                     str(tmp_path)]) == 0
    assert (f"warning: --spill-dir {tmp_path}: 6.00 KiB of expert rows to write there, 100 B free, if the load "
            "transforms the rows") in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--gpu-mem", "--host-mem"])
@pytest.mark.parametrize("value, why", [("0", "'0' is no memory: give a size above zero with its unit"),
                                        ("0GiB", "'0GiB' is no memory"),
                                        ("7", "cannot read a byte size from '7': give a number and a unit")])
def test_plan_memory_sizes_are_above_zero_with_a_unit(tmp_path, capsys, flag, value, why):
    """One rule for ``--gpu-mem`` and ``--host-mem``: a size with its unit (as the help says), above zero."""
    other = {"--gpu-mem": ["--host-mem", "1GiB"], "--host-mem": ["--gpu-mem", "1GiB"]}[flag]
    fails(capsys, "plan", str(tiny_checkpoint(tmp_path / "ckpt")), flag, value, *other,
          fragments=(f"argument {flag}", why))
