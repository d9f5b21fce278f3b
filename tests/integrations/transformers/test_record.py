"""``moepage record`` on Hugging Face models: the routing recorded by hooks on the experts modules is the router's own
top-k, step by step; recording changes no output and leaves no hook; the whole flow record -> ``plan --trace
--budget`` -> ``from_pretrained(resident=split)`` generates exactly what the unpaged model does; bad input is one line
naming the flag or file, before the model is loaded. Tiny random checkpoints, no download."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors  # noqa: F401  (the [test] extra installs it)
import torch
import transformers
from transformers import AutoModelForCausalLM  # noqa: E402

import moepage  # noqa: E402
from helpers.hf import configs, own  # noqa: E402
from moepage import cli  # noqa: E402
from moepage.integrations import transformers as mhf  # noqa: E402
from moepage.integrations.transformers.record import RoutingRecorder, record_routing  # noqa: E402
from moepage.planning import budgets, traces  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [12, 7, 7, 30], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
NEW = 5  # new tokens per prompt: its prefill call, then NEW - 1 decode calls
E, TOP_K, LAYERS = 16, 4, 2  # helpers.hf's tiny qwen3_moe


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    config, _ = configs()["qwen3_moe"]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3_moe")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    (path / "ids.txt").write_text("\n".join(" ".join(map(str, p)) for p in PROMPTS) + "\n\n")
    return path


def unpaged(path: Path) -> torch.nn.Module:
    return own(AutoModelForCausalLM.from_pretrained(path)).eval()  # owned, aligned weights as the paged slots


def greedy(model, ids: list[int]) -> torch.Tensor:
    return model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)


def gate_topk(model) -> tuple[list[list[torch.Tensor]], list]:
    """``calls[l]``: every top-k index the l-th MoE layer's router returned, read off the router's own output."""
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert len(gates) == LAYERS
    calls: list[list[torch.Tensor]] = [[] for _ in gates]
    handles = [g.register_forward_hook(lambda mod, args, out, l=l: calls[l].append(out[2].clone()))
               for l, g in enumerate(gates)]
    return calls, handles


def record_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(["record", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_record_plan_and_page_generates_what_the_unpaged_model_does(ckpt, tmp_path, capsys):
    trace_path, split_path = tmp_path / "t.npz", tmp_path / "split.json"
    code, out, err = record_cli(capsys, str(ckpt), "--token-ids", str(ckpt / "ids.txt"), "--out", str(trace_path),
                                "--max-new-tokens", str(NEW), "--device", "cpu")
    assert code == 0, err
    assert f"wrote {trace_path}: {len(PROMPTS) * NEW} steps" in out
    assert [line for line in err.splitlines() if line.startswith("moepage record: prompt")] == [
        f"moepage record: prompt {i + 1}/{len(PROMPTS)}: {len(p)} tokens in, {NEW} steps recorded"
        for i, p in enumerate(PROMPTS)]

    trace = traces.load_trace(trace_path)
    ref = unpaged(ckpt)
    assert len(trace.layers) == len(moepage.find_experts(ref)) == LAYERS
    assert (trace.num_experts, trace.top_k) == (E, TOP_K)
    assert trace.num_steps == len(PROMPTS) * NEW
    assert trace.prefill_steps == frozenset(range(0, len(PROMPTS) * NEW, NEW))

    assert cli.main(["plan", "--trace", str(trace_path), "--budget", "0.5", "--out", str(split_path),
                     "--jobs", "1"]) == 0
    split = budgets.load_split(split_path)
    assert sorted(split) == list(range(LAYERS)) and sum(split.values()) == E // 2 * LAYERS
    assert all(TOP_K <= k <= E for k in split.values())

    paged = mhf.from_pretrained(str(ckpt), resident=str(split_path), device="cpu", progress=False)
    try:
        assert [layer.num_slots for layer in moepage.paged_layers(paged)] == [split[i] for i in range(LAYERS)]
        for ids in [*PROMPTS, [40, 41, 42, 43, 44, 45]]:
            assert torch.equal(greedy(paged, ids), greedy(ref, ids)), ids
        assert moepage.stats(paged).total.misses > 0
    finally:
        moepage.unwrap(paged)


def test_recorded_ids_are_the_routers_top_k(ckpt, tmp_path, capsys):
    model = unpaged(ckpt)
    calls, handles = gate_topk(model)
    try:
        trace = record_routing(model, PROMPTS, NEW)
    finally:
        for h in handles:
            h.remove()
    assert all(len(c) == len(PROMPTS) * NEW for c in calls)
    for l in range(LAYERS):
        for t in range(trace.num_steps):
            want = tuple(sorted(set(calls[l][t].flatten().tolist())))
            assert trace.layers[l][t] == want, (l, t)
            if t not in trace.prefill_steps:  # one decode token: its k distinct experts
                assert len(want) == TOP_K
    # The command writes the same trace as the library returns.
    out = tmp_path / "t.npz"
    assert record_cli(capsys, str(ckpt), "--token-ids", str(ckpt / "ids.txt"), "--out", str(out),
                      "--max-new-tokens", str(NEW))[0] == 0
    loaded = traces.load_trace(out)
    assert loaded.layers == trace.layers and loaded.prefill_steps == trace.prefill_steps


def test_recording_changes_no_output_and_leaves_no_hook(ckpt):
    model = unpaged(ckpt)
    before = [greedy(model, p) for p in PROMPTS]
    logits = model(torch.tensor([PROMPTS[0]])).logits
    with RoutingRecorder(model) as rec:
        during = [greedy(model, p) for p in PROMPTS]
        during_logits = model(torch.tensor([PROMPTS[0]])).logits
    assert rec.num_steps == len(PROMPTS) * NEW + 1
    assert all(torch.equal(a, b) for a, b in zip(before, during))
    assert torch.equal(logits, during_logits)
    assert not any(m._forward_pre_hooks for m in model.modules())

    # An error part-way through generate: the recorder's hooks go, the test's own stays.
    experts = moepage.find_experts(model)[-1][1]
    seen = []

    def fail_on_third(module, args):
        seen.append(1)
        if len(seen) == 3:
            raise RuntimeError("boom")

    own_hook = experts.register_forward_pre_hook(fail_on_third)
    with pytest.raises(RuntimeError, match="boom"):
        record_routing(model, PROMPTS, NEW)
    assert list(experts._forward_pre_hooks.values()) == [fail_on_third]
    own_hook.remove()
    assert not any(m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("arch", list(configs()))
def test_every_architecture_records_its_moe_layers_and_top_k(arch):
    config, _ = configs()[arch]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    trace = record_routing(model, [[1, 2, 3, 4, 5]], 3)
    experts = moepage.find_experts(model)
    dense = getattr(config, "first_k_dense_replace", 0)  # deepseek_v3, glm4_moe: a dense first layer, no experts
    assert len(trace.layers) == len(experts) == config.num_hidden_layers - dense
    assert trace.num_experts == experts[0][1].gate_up_proj.shape[0] and trace.top_k == config.num_experts_per_tok
    assert trace.num_steps == 3 and trace.prefill_steps == frozenset({0})
    assert all(len(layer[t]) == trace.top_k for layer in trace.layers for t in (1, 2))  # one decode token each


def test_a_wrapped_model_records_the_same_trace(ckpt):
    plain = record_routing(unpaged(ckpt), PROMPTS, NEW)
    paged = mhf.from_pretrained(str(ckpt), resident=TOP_K + 1, device="cpu", progress=False)
    try:
        got = record_routing(paged, PROMPTS, NEW)
    finally:
        moepage.unwrap(paged)
    assert got.num_experts == E  # the module's, not its K slots
    assert got.layers == plain.layers and got.prefill_steps == plain.prefill_steps


def word_tokenizer(path: Path, words: list[str]) -> None:
    """A word-level tokenizer saved beside the checkpoint (built locally: no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)


def test_text_prompts_go_through_the_checkpoints_tokenizer(ckpt, tmp_path, capsys):
    import tokenizers  # noqa: F401  (the [test] extra installs it)
    model_dir = tmp_path / "with_tokenizer"
    model_dir.mkdir()
    for f in ckpt.iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    word_tokenizer(model_dir, "the a cat dog sat on mat ran".split())
    texts = ["the cat sat on the mat", "a dog ran"]
    (tmp_path / "p.txt").write_text("\n".join(texts) + "\n")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    (tmp_path / "ids.txt").write_text("1 3 5 6 1 7\n2 4 8\n")  # the same prompts, tokenised by hand
    made = {}
    for flag, name in (("--prompts", "p.txt"), ("--prompts", "p.jsonl"), ("--token-ids", "ids.txt")):
        out = tmp_path / f"{name}.npz"
        code, _, err = record_cli(capsys, str(model_dir), flag, str(tmp_path / name), "--out", str(out),
                                  "--max-new-tokens", "3")
        assert code == 0, err
        made[name] = traces.load_trace(out)
    assert made["p.txt"].num_steps == 2 * 3
    assert made["p.txt"].layers == made["p.jsonl"].layers == made["ids.txt"].layers


def one_line_error(capsys, *argv: str, fragments: tuple[str, ...]) -> None:
    code, out, err = record_cli(capsys, *argv)
    assert code == 2, (code, out, err)
    assert out == "" and err.count("\n") == 1 and err.startswith("moepage record: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading the weights fails the test: errors must come before it."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load)


def test_bad_input_is_one_line_before_the_model_loads(ckpt, tmp_path, capsys, no_model_load, monkeypatch):
    ids, out = str(ckpt / "ids.txt"), str(tmp_path / "t.npz")
    one_line_error(capsys, str(ckpt), "--token-ids", ids, "--out", str(tmp_path / "t.json"),
                   fragments=("--out", "t.json", ".npz"))
    one_line_error(capsys, str(ckpt), "--token-ids", ids, "--out", str(tmp_path / "nowhere" / "t.npz"),
                   fragments=("--out", "nowhere", "does not exist"))
    one_line_error(capsys, str(ckpt), "--out", out, fragments=("--prompts", "--token-ids"))
    one_line_error(capsys, str(ckpt), "--prompts", ids, "--token-ids", ids, "--out", out,
                   fragments=("--prompts", "--token-ids", "one of the two"))
    one_line_error(capsys, "--token-ids", ids, "--out", out, fragments=("MODEL_DIR", "--sglang-dump", "none"))
    one_line_error(capsys, str(ckpt), "--token-ids", ids, "--out", out, "--max-new-tokens", "0",
                   fragments=("--max-new-tokens", "'0'"))
    one_line_error(capsys, str(ckpt), "--token-ids", ids, "--out", out, "--device", "tpu:0",
                   fragments=("device='tpu:0'",))
    (tmp_path / "big.txt").write_text("1 2 3\n4 96 5\n")
    one_line_error(capsys, str(ckpt), "--token-ids", str(tmp_path / "big.txt"), "--out", out,
                   fragments=("prompt 2", "96", "0..95"))
    (tmp_path / "bad.txt").write_text("1 2\n3 x4\n")
    one_line_error(capsys, str(ckpt), "--token-ids", str(tmp_path / "bad.txt"), "--out", out,
                   fragments=("bad.txt:2", "'x4'"))
    (tmp_path / "p.jsonl").write_text('{"text": "hi"}\n{"prompt": "no text"}\n')
    one_line_error(capsys, str(ckpt), "--prompts", str(tmp_path / "p.jsonl"), "--out", out,
                   fragments=("p.jsonl:2", '"text"'))
    (tmp_path / "p.txt").write_text("a prompt\n")
    one_line_error(capsys, str(ckpt), "--prompts", str(tmp_path / "p.txt"), "--out", out,
                   fragments=(str(ckpt), "no usable tokenizer", "--token-ids"))
    one_line_error(capsys, str(tmp_path), "--token-ids", ids, "--out", out,
                   fragments=(str(tmp_path), "config.json"))
    # a mistyped folder is never taken for a hub id (transformers would ask the hub for it)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: pytest.fail("asked transformers for a missing folder"))
    one_line_error(capsys, str(tmp_path / "nosuch"), "--token-ids", ids, "--out", out,
                   fragments=(str(tmp_path / "nosuch"), "no such checkpoint directory"))
    assert not (tmp_path / "t.npz").exists()


BLOCKING_CHILD = """
import sys
class Blocker:  # as if these were not installed
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Blocker())
from moepage.cli import main
code = main(sys.argv[1:])
assert not [m for m in sys.modules if m.partition(".")[0] in BLOCKED], "half-imported"
sys.exit(code)
"""


@pytest.mark.parametrize("blocked, message", [
    ({"transformers"}, 'moepage record: MODEL_DIR needs transformers: pip install "moepage[transformers]"\n'),
    ({"numpy", "transformers"}, 'moepage record: needs numpy: pip install "moepage[traces]"\n'),
])
def test_a_missing_extra_is_named(ckpt, tmp_path, blocked, message):
    argv = ["record", str(ckpt), "--token-ids", str(ckpt / "ids.txt"), "--out", str(tmp_path / "t.npz")]
    child = subprocess.run([sys.executable, "-c", f"BLOCKED = {blocked!r}\n" + BLOCKING_CHILD, *argv], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert (child.returncode, child.stdout, child.stderr) == (2, "", message)


def test_the_example_runs_and_pages_exactly():
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "record_plan_wrap.py")], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "recorded 24 steps (3 prefill) of 4 MoE layers, E=16, top_k=4"
    assert "budget 32 slots" in done.stdout
    planned = [int(line.rpartition("K = ")[2]) for line in lines if line.startswith("  layer ")]
    assert len(planned) == 4 and sum(planned) == 32
    assert f"resident per layer: {planned}" in lines  # the split is what the paged model keeps
    assert "DIFFERS" not in done.stdout and lines[-1] == "paged output equals unpaged: True"
