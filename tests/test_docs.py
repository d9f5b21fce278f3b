"""README.md and docs/*.md cannot drift from the code.

- Every ```python block runs: the blocks of one file in order, in one fresh namespace per file, with
  grad mode on (as a user's script has it), in a temporary working directory, on one CPU thread. A block that needs
  a GPU, a download or a server is marked on the line before it with ``<!-- doc: skip (reason) -->``
  (a reason is required). A block using a placeholder checkpoint path gets a fixture:
  ``<!-- doc: setup tiny-checkpoint "/models/Qwen3-30B-A3B" -->`` builds a tiny random Qwen3-MoE
  checkpoint (with a word-level tokenizer) and puts its path in place of the quoted placeholder;
  ``setup split-file`` writes ``split.json`` for that checkpoint (``moepage plan --trace``);
  ``setup toy-model`` binds ``model`` to a small ``moepage.toy.ToyMoE`` and ``tokens`` to a prompt.
- Every line of a ```bash block that runs ``moepage ...`` is parsed by ``moepage.cli.build_parser()``,
  so a flag or command that does not exist fails here. ``<!-- doc: pending (reason) -->`` marks a
  block documented ahead of the code: it is checked all the same, and its reason is in the failure.
  ``python -m bench.X`` names a module that exists, ``python FILE.py`` a file;
  ``python -m sglang.launch_server ...`` parses with SGLang's parser plus moepage's plugin flags.
- Every relative link points to a file that exists.
- The generated blocks (between ``<!-- generated:NAME start ... -->`` and ``<!-- generated:NAME end -->``)
  equal what the code gives now: the MOEPAGE_* table (``moepage.config.ENV`` and the SGLang
  plugin's settings), the API signatures, the SGLang flags and formats. Refresh them with

      MOEPAGE_UPDATE_DOCS=1 python -m pytest -q tests/test_docs.py
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import json
import os
import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
UPDATE = os.environ.get("MOEPAGE_UPDATE_DOCS", "").lower() in ("1", "true", "yes", "on")
REFRESH = "MOEPAGE_UPDATE_DOCS=1 python -m pytest -q tests/test_docs.py"

FENCE = re.compile(r"^\s*```(\w*)\s*$")  # indented in a list item too
DIRECTIVE = re.compile(r"^\s*<!--\s*doc:\s*(.*?)\s*-->\s*$")
KINDS = ("skip", "setup", "pending")
SETUPS = ("tiny-checkpoint", "split-file", "toy-model")

# The tiny checkpoint of the ``tiny-checkpoint`` fixture: Qwen3-30B-A3B's E and top_k (so the K values the
# docs use are valid), two MoE layers of toy width.
TINY = dict(num_hidden_layers=2, num_experts=128, num_experts_per_tok=8, hidden_size=64, moe_intermediate_size=32)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- reading the markdown -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    directive: str | None  # the ``doc:`` comment on the line before the fence

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"

    @property
    def kind(self) -> str | None:
        return self.directive.split(None, 1)[0] if self.directive else None

    @property
    def reason(self) -> str:
        m = re.search(r"\((.*)\)", self.directive or "")
        return m.group(1).strip() if m else ""

    def setups(self) -> list[tuple[str, str | None]]:
        """``setup NAME ["ARG"]; NAME ...`` as (name, arg) pairs."""
        body = (self.directive or "").split(None, 1)[1] if self.kind == "setup" and " " in self.directive else ""
        out = []
        for part in filter(None, (p.strip() for p in body.split(";"))):
            name, _, arg = part.partition(" ")
            out.append((name, json.loads(arg) if arg.strip() else None))
        return out


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` (``lang`` "" where the fence names none)."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        before = DIRECTIVE.match(lines[start - 1]) if start else None
        out.append(Block(path, start + 1, m.group(1), textwrap.dedent("\n".join(lines[start + 1:i]) + "\n"),
                         before.group(1) if before else None))
        i += 1
    return out


def prose(path: Path) -> str:
    """The file without its fenced blocks (links in code are code)."""
    return re.sub(r"^\s*```.*?^\s*```", "", path.read_text(), flags=re.S | re.M)


def commands(text: str) -> list[list[str]]:
    """The shell commands of a bash block: continuation lines joined, comments dropped, split on && ; | ||,
    leading VAR=value assignments removed."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split, lex.commenters = True, "#"
        argv: list[str] = []
        for token in [*lex, ";"]:
            if token and set(token) <= set(";&|"):
                while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
                    argv.pop(0)
                if argv:
                    out.append(argv)
                argv = []
            else:
                argv.append(token)
    return out


def all_blocks(lang: str) -> list[Block]:
    return [b for path in DOCS for b in blocks(path) if b.lang == lang]


# -- fixtures of the python blocks -----------------------------------------------------------------------------
def _tokenizer(path: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = "the of and to a in is it that was for on are with as his they be at one have this from capital " \
            "france paris hello world model expert experts layer memory gpu host".split()
    table = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    table.update({f"w{i}": i for i in range(len(table), vocab)})
    tok = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "</s>", "bos_token": None,
         "pad_token": "<unk>", "model_max_length": 512}))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE checkpoint (per-expert keys, as on the hub) and a word-level tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    config = Qwen3MoeConfig(vocab_size=256, intermediate_size=64, head_dim=16, num_attention_heads=4,
                            num_key_value_heads=2, initializer_range=0.1, bos_token_id=None, eos_token_id=1,
                            pad_token_id=0, **TINY)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add hand-offs
    try:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    finally:
        torch.set_num_threads(threads)
    _tokenizer(path, config.vocab_size)
    return path


def _split_file(cwd: Path) -> None:
    """``split.json`` for the tiny checkpoint's layers: a synthetic trace, then ``moepage plan --trace``."""
    from moepage import cli
    from moepage.planning import synthetic, traces

    gen = synthetic.uniform(TINY["num_hidden_layers"], TINY["num_experts"], TINY["num_experts_per_tok"], 0.3, 0)
    traces.save_simple(cwd / "trace.npz", synthetic.synthetic_ids(gen, 64, 1), gen.num_experts, gen.top_k)
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["plan", "--trace", str(cwd / "trace.npz"), "--budget", "0.5", "--out",
                         str(cwd / "split.json"), "--jobs", "1"]) == 0


def _toy_model(namespace: dict) -> None:
    from moepage.toy import ToyMoE

    torch.manual_seed(0)
    namespace["model"] = ToyMoE(vocab=512, hidden=64, inter=128, layers=4, num_experts=16, top_k=4).eval()
    namespace["tokens"] = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(0))


# -- python blocks run ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [p for p in DOCS if any(b.lang == "python" for b in blocks(p))], ids=rel)
def test_python_blocks_run(path, tmp_path, monkeypatch, request, single_thread):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict = {"__name__": f"doc:{rel(path)}"}
    ran = 0
    for block in (b for b in blocks(path) if b.lang == "python"):
        if block.kind == "skip":
            continue
        source = block.text
        for name, arg in block.setups():
            if name == "tiny-checkpoint":
                assert arg and f'"{arg}"' in source, f"{block.where}: the placeholder {arg!r} is not in the block"
                source = source.replace(f'"{arg}"', repr(str(request.getfixturevalue("tiny_checkpoint"))))
            elif name == "split-file":
                _split_file(tmp_path)
            elif name == "toy-model":
                _toy_model(namespace)
        with torch.enable_grad(), contextlib.redirect_stdout(io.StringIO()):
            try:
                exec(compile(source, block.where, "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"{block.where}: the python block failed: {type(exc).__name__}: {exc}") from exc
        ran += 1
    assert ran, f"{rel(path)}: every python block is skipped"


def test_directives_are_known_and_skips_say_why():
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if not line.lstrip().startswith("<!-- doc:"):
                continue
            m = DIRECTIVE.match(line)
            assert m, f"{rel(path)}:{i + 1}: malformed directive {line!r}"
            kind = m.group(1).split(None, 1)[0] if m.group(1) else ""
            assert kind in KINDS, f"{rel(path)}:{i + 1}: unknown directive {kind!r} (known: {', '.join(KINDS)})"
            assert i + 1 < len(lines) and FENCE.match(lines[i + 1]), \
                f"{rel(path)}:{i + 1}: a directive goes on the line right before a fenced block"
    for path in DOCS:
        for block in blocks(path):
            assert block.lang, f"{block.where}: a fenced block names its language (python, bash, text, ...)"
    for block in [*all_blocks("python"), *all_blocks("bash")]:
        if block.kind in ("skip", "pending"):
            assert block.reason, f"{block.where}: '{block.kind}' needs a reason: <!-- doc: {block.kind} (why) -->"
        for name, _ in block.setups():
            assert name in SETUPS, f"{block.where}: unknown setup {name!r} (known: {', '.join(SETUPS)})"


# -- bash blocks: moepage commands parse, modules and files exist ------------------------------------------------
def _parse(parser, argv: list[str]) -> str | None:
    """None if ``argv`` parses, else argparse's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as exc:
        lines = err.getvalue().strip().splitlines()
        return None if exc.code == 0 else (lines[-1] if lines else f"exit {exc.code}")  # the error, not the usage
    return None


def _failure(block: Block, argv: list[str], why: str) -> str:
    ahead = f" [documented ahead of the code: {block.reason}]" if block.kind == "pending" else ""
    return f"{block.where}: {shlex.join(argv)}: {why}{ahead}"


def test_moepage_commands_parse():
    from moepage.cli import build_parser

    failures, seen = [], 0
    for block in all_blocks("bash"):
        for argv in commands(block.text):
            if argv[0] != "moepage":
                continue
            seen += 1
            if why := _parse(build_parser(), argv[1:]):
                failures.append(_failure(block, argv, why))
    assert seen, "no moepage command in the docs"
    assert not failures, "moepage commands in the docs that the CLI does not take:\n" + "\n".join(failures)


def test_python_commands_name_what_exists():
    failures = []
    for block in all_blocks("bash"):
        for argv in commands(block.text):
            if argv[0] not in ("python", "python3"):
                continue
            if argv[1:2] == ["-m"] and argv[2].startswith("bench."):
                if importlib.util.find_spec(argv[2]) is None:
                    failures.append(_failure(block, argv, f"no module {argv[2]}"))
            elif len(argv) > 1 and argv[1].endswith(".py") and not (ROOT / argv[1]).is_file():
                failures.append(_failure(block, argv, f"no file {argv[1]}"))
    assert not failures, "\n".join(failures)


def test_sglang_launch_commands_parse():
    import argparse

    import sglang.srt.server_args  # noqa: F401  (the [test] extra installs it)
    from sglang.srt.server_args import ServerArgs

    from moepage.integrations.sglang import plugin

    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    plugin.add_cli_args(None, parser)
    failures, seen = [], 0
    for block in all_blocks("bash"):
        for argv in commands(block.text):
            if argv[:3] in (["python", "-m", "sglang.launch_server"], ["python3", "-m", "sglang.launch_server"]):
                seen += 1
                if why := _parse(parser, argv[3:]):
                    failures.append(_failure(block, argv, why))
    assert seen, "no sglang.launch_server command in the docs"
    assert not failures, "\n".join(failures)


# -- the README's first commands are CI's ---------------------------------------------------------------------
CI_COMMANDS = [["pip", "install", "-e", ".[test]"], ["python", "examples/quickstart.py"], ["pytest"]]


def test_readme_opens_with_the_commands_ci_runs():
    lines = README.read_text().splitlines()
    first = blocks(README)[0]
    assert first.lang == "bash" and all(not line.strip() or line.startswith("# ") for line in lines[:first.line - 1]), \
        "README.md: the first thing after the title is the bash block of CI's set-up"
    assert commands(first.text) == CI_COMMANDS, f"README.md:{first.line}: the first commands must be CI's own"
    # .ci/run runs that block itself, in a fresh venv, and nothing else (no install between the two commands).
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert ci[-3].startswith("commands=$(awk '/^```bash$/") and "README.md" in ci[-3], ".ci/run reads the README"
    assert ci[-1] == 'bash -euxo pipefail -c "$commands"'
    assert not [line for line in ci if "pip " in line or "pytest" in line], ".ci/run runs the README's commands only"


def test_tests_shadow_no_dependency():
    """With ``pythonpath = ["tests"]`` a folder of the tests named like a package (``tests/sglang``) is importable as
    that package where the package is missing: ``import sglang`` then finds the tests, not SGLang."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    specs = project["dependencies"] + [s for extra in project["optional-dependencies"].values() for s in extra]
    packages = {re.split(r"[<>=!~\[ ;]", s, maxsplit=1)[0].lower().replace("-", "_") for s in specs}
    packages |= {p.split("_")[0] for p in packages}  # cuda_python -> cuda, ...
    for entry in pyproject["tool"]["pytest"]["ini_options"]["pythonpath"]:
        folders = {p.name.lower() for p in (ROOT / entry).iterdir() if p.is_dir()}
        assert not folders & packages, f"{entry}/: folders named like dependencies: {sorted(folders & packages)}"


def test_the_test_extra_is_installed():
    """Every test runs: a module the ``[test]`` extra installs is imported, never skipped, so a missing one is an
    error here rather than a silent skip elsewhere."""
    from importlib.metadata import PackageNotFoundError, version

    tomllib = pytest.importorskip("tomllib")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    missing = []
    for spec in extra:
        name = re.split(r"[<>=!~\[ ;]", spec, maxsplit=1)[0]
        try:
            version(name)
        except PackageNotFoundError:
            missing.append(name)
    assert not missing, f"not installed: {missing}; run the README's first command (pip install -e \".[test]\")"
    import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the real SGLang, not a folder of the tests)


def test_lint_is_clean():
    """The linter (configured in pyproject.toml) is part of the tests, so the README's second command runs it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_readme_installs_extras_that_exist():
    tomllib = pytest.importorskip("tomllib")
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = set()
    for path in DOCS:
        for spec in re.findall(r"moepage\[([a-z,]+)\]", path.read_text()):
            named |= set(spec.split(","))
    assert "transformers" in named and "sglang" in named
    assert named <= extras, f"the docs install extras pyproject.toml lacks: {sorted(named - extras)}"


# -- links -----------------------------------------------------------------------------------------------------
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def slugs(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path``."""
    heads = re.findall(r"^#+\s+(.*?)\s*$", prose(path), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_relative_links_point_to_files():
    broken = []
    for path in DOCS:
        for target in LINK.findall(prose(path)):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file) if file else path
            if not dest.exists():
                broken.append(f"{rel(path)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
                broken.append(f"{rel(path)}: {target} (no heading #{anchor} in {rel(dest.resolve())})")
    assert not broken, "relative links to nothing:\n" + "\n".join(broken)


def test_docs_pages_open_with_what_they_cover():
    for path in DOCS[1:]:
        text = path.read_text().split("\n\n")
        assert text[0].startswith("# ") and len(text) > 1 and not text[1].startswith(("#", "|", "```", "-")), \
            f"{rel(path)}: a title, then one paragraph saying what the page covers"


# -- the README stays a five-minute read; its terms are defined ------------------------------------------------
GLOSSARY = ROOT / "docs" / "glossary.md"


def test_readme_is_short_and_its_terms_are_defined():
    text = README.read_text()
    assert len(text.splitlines()) <= 200, "README.md: keep it a five-minute read; move details to docs/"
    defined = {t.lower() for t in re.findall(r"^- \*\*(.+?)\.\*\*", GLOSSARY.read_text(), flags=re.M)}
    terms = {t.lower() for t in re.findall(r"\*\*([a-z][a-z -]*)\*\*", prose(README))}
    missing = {t for t in terms if not any(t in d for d in defined)}
    assert terms and not missing, f"README.md: terms in bold that {rel(GLOSSARY)} does not define: {sorted(missing)}"
    for path in (README, ROOT / "docs" / "internals.md"):
        assert "glossary.md" in path.read_text(), f"{rel(path)} links the glossary"


# -- the worked host-memory example (docs/choosing-k.md) is arithmetic, not a guess ----------------------------
CHOOSING_K = ROOT / "docs" / "choosing-k.md"  # where the README sends a user choosing K


def test_host_memory_example():
    hidden, inter, experts, layers = 2048, 768, 128, 48  # Qwen3-30B-A3B's config.json
    per_expert = 3 * hidden * inter * 2
    text = CHOOSING_K.read_text()
    for number in (per_expert, per_expert * experts * layers, per_expert * layers):
        assert f"{number:,}" in text, f"{rel(CHOOSING_K)}: the host-memory example should show {number:,}"
    assert "(docs/choosing-k.md)" in README.read_text(), "README.md links the page that chooses K"


# -- moepage plan's recommendation, as the README and docs/choosing-k.md show it ----------------------------
def test_plan_prints_recommended_k_and_host_memory(tiny_checkpoint):
    """The docs say ``moepage plan CHECKPOINT --gpu-mem ... --reserve ...`` prints a recommended K (the largest
    that leaves the reserve) and the host memory a paged load needs."""
    from moepage import cli
    from moepage.planning.sizing import checkpoint_size

    size = checkpoint_size(tiny_checkpoint)
    budget = size.dense_bytes + 20 * size.slot_bytes + 4096
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["plan", str(tiny_checkpoint), "--gpu-mem", f"{budget}B", "--reserve", "4096B"]) == 0
    text = out.getvalue()
    recommended = [line for line in text.splitlines() if "recommend" in line.lower()]
    assert recommended and re.search(r"\b20\b", recommended[0]), f"no recommended K = 20 in:\n{text}"
    assert re.search(r"host", text, re.I), f"no host memory figure in:\n{text}"


# -- generated blocks -----------------------------------------------------------------------------------------------
def _md(text: str) -> str:
    return text.replace("|", "\\|")


def env_table() -> str:
    """Every MOEPAGE_* variable: moepage.config.ENV, then the engine options' own (``integrations.flags``, the one
    table, and its views in the plugins' settings: leaf modules), with the flag or option that sets the same thing in
    each plugin."""
    from moepage.integrations.flags import variables
    from moepage.integrations.sglang.settings import FLAGS
    from moepage.integrations.vllm.settings import OPTIONS

    flags = {flag.env.name: flag.flag for flag in FLAGS.values()}
    options = {o.env.name: f"{o.flag}` / `{o.key}" for o in OPTIONS.values() if o.env is not None}
    settings = variables()

    def default(value) -> str:
        if value is None:
            return "unset"
        if isinstance(value, bool):
            return "`on`" if value else "`off`"
        return f"`{value}`"

    def applies(s) -> str:
        return ", ".join("`wrap`, `from_pretrained`" if where == "wrap" else where for where in s.applies)

    def code(text: str | None) -> str:
        return f"`{text}`" if text else ""

    lines = ["| variable | default | what it sets | applies to | SGLang flag | vLLM flag / option |",
             "|---|---|---|---|---|---|"]
    for name, s in settings.items():
        lines.append(f"| `{name}` | {default(s.default)} | {_md(s.help)} | {applies(s)} | {code(flags.get(name))} | "
                     f"{code(options.get(name))} |")
    return "\n".join(lines)


def _signature(qualname: str, fn) -> str:
    parts, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    lines, line = [], f"{qualname}("
    for i, part in enumerate(parts):
        piece = part + (", " if i < len(parts) - 1 else ")")
        if len(line) + len(piece) > 100:
            lines.append(line.rstrip())
            line = "    "
        line += piece
    if not parts:
        line += ")"
    return "\n".join([*lines, line])


def signatures() -> str:
    import moepage
    from moepage.integrations import transformers as mhf
    from moepage.planning import budgets

    rows = [("moepage.wrap", moepage.wrap), ("moepage.unwrap", moepage.unwrap), ("moepage.stats", moepage.stats),
            ("moepage.capture_mode", moepage.capture_mode), ("mhf.from_pretrained", mhf.from_pretrained),
            ("mhf.check_supported", mhf.check_supported),
            ("moepage.planning.budgets.load_split", budgets.load_split)]
    return "```text\n" + "\n".join(_signature(name, fn) for name, fn in rows) + "\n```"


def sglang_flags() -> str:
    from moepage.integrations.sglang.settings import FLAGS

    lines = ["| flag | environment (`Engine` API) | what it does |", "|---|---|---|"]
    for flag in FLAGS.values():
        help_text = re.sub(r"\s*Environment: \w+\.$", "", flag.options.get("help", ""))
        choices = flag.options.get("choices")
        metavar = flag.options.get("metavar") or ("{" + ",".join(choices) + "}" if choices
                                                  else flag.dest.split("_")[-1].upper())
        usage = flag.flag if flag.options.get("action") == "store_true" else f"{flag.flag} {metavar}"
        lines.append(f"| `{usage}` | `{flag.env.name}` | {_md(help_text)} |")
    return "\n".join(lines)




def sglang_formats() -> str:
    import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)

    from moepage.integrations.sglang import checks, compat

    lines = ["| format (SGLang's label) | SGLang class | moepage | CUDA graphs |", "|---|---|---|---|"]
    for fmt in compat.sglang_formats.FORMATS:
        name = fmt.__name__
        served = "**served**" if name in checks.SERVED else "refused at startup"
        if name in checks.SERVED and (bits := checks.CHECKED_BITS.get(name)):
            served += f" ({' or '.join(map(str, bits))}-bit weights)"
        graphs = "decode captured, prefill breakable" if name in checks.SERVED else "—"
        lines.append(f"| {_md(fmt.label)} | `{name}` | {served} | {graphs} |")
    return "\n".join(lines)


def vllm_options() -> str:
    from moepage.integrations.vllm.settings import OPTIONS

    lines = ["| flag | `additional_config[\"moepage\"]` key | environment | what it does |", "|---|---|---|---|"]
    for option in OPTIONS.values():
        help_text = re.sub(r"\s*Environment: \w+\.$", "", option.options.get("help", ""))
        metavar = option.options.get("metavar") or option.key.split("_")[-1].upper()
        usage = option.flag if option.options.get("action") == "store_true" else f"{option.flag} {metavar}"
        env = f"`{option.env.name}`" if option.env is not None else ""
        lines.append(f"| `{usage}` | `{option.key}` | {env} | {_md(help_text)} |")
    return "\n".join(lines)


GENERATED = {  # name -> (file, generator)
    "env-table": ("docs/reference.md", env_table),
    "signatures": ("docs/reference.md", signatures),
    "sglang-flags": ("docs/serving.md", sglang_flags),
    "vllm-options": ("docs/serving.md", vllm_options),
    "sglang-formats": ("docs/formats.md", sglang_formats),
}


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- generated:{name} start ({REFRESH}) -->", f"<!-- generated:{name} end -->"


@pytest.mark.parametrize("name", list(GENERATED))
def test_generated_blocks_are_current(name):
    file, make = GENERATED[name]
    path = ROOT / file
    start, end = _markers(name)
    text = path.read_text()
    assert start in text and end in text, f"{file}: the markers of {name} are missing:\n{start}\n{end}"
    before, rest = text.split(start, 1)
    current, after = rest.split(end, 1)
    want = "\n" + make() + "\n"
    if UPDATE and current != want:
        path.write_text(before + start + want + end + after)
        return
    assert current == want, f"{file}: the generated {name} block is stale; refresh it with {REFRESH}"


def test_results_keep_one_current_table_per_claim():
    """bench/RESULTS.md holds the current measurement of each claim; older runs go to docs/results-history.md."""
    lines = (ROOT / "bench" / "RESULTS.md").read_text().splitlines()
    assert len(lines) <= 400, f"bench/RESULTS.md has {len(lines)} lines: move superseded runs to the history"
