"""The real server's argument path on CPU: ``python -m sglang.launch_server`` with moepage's flags runs SGLang's own
``__main__`` (plugins loaded, arguments parsed and resolved) up to the HTTP server, which is replaced by a probe
that reports what the scheduler processes would receive."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import sglang  # noqa: F401  (the [test] extra installs it)
from test_sglang_settings import _plugin_env  # noqa: E402  (tests/integrations/sglang is on the path under pytest)

# Stands in for sglang.srt.entrypoints.http_server (whose imports need the GPU install): its launch_server receives
# the server args exactly as launch_server's __main__ built them, pickles them as the scheduler's spawn does, and
# prints the fields the plugin reads.
PROBE = textwrap.dedent("""
    import json, pickle, runpy, sys, types
    http = types.ModuleType("sglang.srt.entrypoints.http_server")
    def launch_server(server_args):
        args = pickle.loads(pickle.dumps(server_args))
        from moepage.integrations.sglang.settings import FLAGS
        seen = {"enable_paged_experts": args.enable_paged_experts,
                "paged_experts_num_resident": args.paged_experts_num_resident}
        seen.update({dest: getattr(args, flag.attr, None) for dest, flag in FLAGS.items()})
        print("SERVER_ARGS " + json.dumps(seen, default=str))
    http.launch_server = launch_server
    sys.modules[http.__name__] = http
    sys.argv = ["sglang.launch_server", *sys.argv[1:]]
    runpy.run_module("sglang.launch_server", run_name="__main__")
""")


def _launch(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    from transformers import Qwen3MoeConfig

    model = tmp_path / "model"  # a config is enough: the server resolves its arguments against it
    Qwen3MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, hidden_size=64, intermediate_size=128,
                   moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                   architectures=["Qwen3MoeForCausalLM"]).save_pretrained(model)
    argv = [sys.executable, "-c", PROBE, "--model-path", str(model), "--skip-tokenizer-init", "--device", "cpu", *flags]
    return subprocess.run(argv, env=_plugin_env(tmp_path, None), capture_output=True, text=True, timeout=240)


def _seen(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    line = next((x for x in out.stdout.splitlines() if x.startswith("SERVER_ARGS ")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(line.removeprefix("SERVER_ARGS "))


def test_launch_server_carries_the_plugin_flags_to_the_server(tmp_path):
    seen = _seen(_launch(tmp_path, "--enable-paged-experts", "--paged-experts-num-resident", "6",
                         "--paged-experts-policy", "lfru:16", "--paged-experts-prefetch", "off"))
    assert seen["enable_paged_experts"] is True and seen["paged_experts_num_resident"] == 6
    assert seen["paged_experts_policy"] == "lfru:16" and seen["paged_experts_prefetch"] == "off", seen


def test_launch_server_takes_auto_and_the_builtin_choice(tmp_path):
    seen = _seen(_launch(tmp_path, "--enable-paged-experts", "--paged-experts-num-resident", "auto",
                         "--paged-experts-impl", "sglang"))
    assert seen["paged_experts_num_resident"] == "auto" and seen["paged_experts_impl"] == "sglang", seen


@pytest.mark.parametrize("flags,named", [
    (["--paged-experts-num-resident", "lots"], "--paged-experts-num-resident"),
    (["--paged-experts-impl", "vllm"], "--paged-experts-impl"),
])
def test_launch_server_refuses_bad_plugin_flags_by_name(tmp_path, flags, named):
    out = _launch(tmp_path, "--enable-paged-experts", *flags)
    assert out.returncode != 0 and "SERVER_ARGS" not in out.stdout
    assert named in out.stderr, out.stderr[-2000:]
