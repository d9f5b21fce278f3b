"""SGLang's per-token expert distribution dumps as routing traces: a dump written by SGLang's own recorder classes
(``_ExpertDistributionRecorderReal`` in ``per_token`` mode, on CPU) converts to the trace of its logical expert ids;
``moepage record --sglang-dump`` writes it; ``moepage record --sglang-url`` drives a server's recorder over HTTP (a
stand-in server here) and converts the dump it writes."""

from __future__ import annotations

import json
import os
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import sglang  # noqa: F401  (the [test] extra installs it)
import torch

from helpers.sglang import server_args  # noqa: E402
from moepage import cli  # noqa: E402
from moepage.integrations.sglang import routing_dump  # noqa: E402
from moepage.planning import traces  # noqa: E402

LAYERS, E, TOP_K = 3, 8, 2  # decoder layer 0 is dense: the recorder never sees it
# Physical -> logical per layer: a permutation of the 8 experts, then replicas (physical 8, 9) of two of them.
P2L = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1],
                    [7, 6, 5, 4, 3, 2, 1, 0, 3, 5],
                    [2, 0, 1, 3, 6, 4, 7, 5, 6, 2]])
PHYSICAL = P2L.shape[1]


def passes():
    """``(forward mode, {layer: physical ids [tokens, k]})`` of each forward pass, an idle one among them."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    g = torch.Generator().manual_seed(0)
    out = []
    for mode, tokens in ((ForwardMode.EXTEND, 5), (ForwardMode.DECODE, 1), (ForwardMode.IDLE, 0),
                         (ForwardMode.DECODE, 1), (ForwardMode.MIXED, 3)):
        ids = {l: torch.stack([torch.randperm(PHYSICAL, generator=g)[:TOP_K] for _ in range(tokens)]).int()
               if tokens else torch.zeros(0, TOP_K, dtype=torch.int32) for l in (1, 2)}
        out.append((mode, ids))
    return out


def write_dump(directory: Path, monkeypatch) -> Path:
    """Record ``passes()`` with SGLang's own recorder and dump it as the server's ``/dump`` does."""
    from sglang.srt.eplb import expert_distribution as ed
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata

    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(directory))
    l2p = torch.full((LAYERS, E, PHYSICAL), -1)
    for l in range(LAYERS):
        for logical in range(E):
            replicas = (P2L[l] == logical).nonzero().flatten()
            l2p[l, logical, : len(replicas)] = replicas
    meta = ExpertLocationMetadata(P2L, P2L, l2p, l2p, (l2p >= 0).sum(-1), 1, None)
    with server_args(expert_distribution_recorder_mode="per_token", chunked_prefill_size=64):
        recorder = ed._ExpertDistributionRecorderReal(meta, rank=0)
        recorder.start_record()
        for pass_id, (mode, ids) in enumerate(passes()):
            n = ids[1].shape[0]
            batch = types.SimpleNamespace(input_ids=torch.arange(n), positions=torch.arange(n),
                                          extend_seq_lens_cpu=[n], forward_mode=mode)
            with recorder.with_forward_pass(pass_id, batch):
                for l, topk in ids.items():
                    with recorder.with_current_layer(l):
                        recorder.on_select_experts(topk)
        recorder.stop_record()
        recorder.dump_record()
    (path,) = directory.glob("expert_distribution_recorder_*_0.pt")
    return path


def expected_steps() -> list[list[tuple[int, ...]]]:
    """``steps[t][i]``: the logical experts of MoE layer i (decoder layer i + 1) in pass t, idle passes left out."""
    return [[tuple(sorted({int(P2L[l, p]) for p in ids[l].flatten()})) for l in (1, 2)]
            for _, ids in passes() if ids[1].numel()]


@pytest.fixture
def dump(tmp_path, monkeypatch) -> Path:
    return write_dump(tmp_path / "dumps", monkeypatch)


def test_the_dump_sglang_writes_is_the_trace_of_its_logical_ids(dump):
    data = torch.load(dump, weights_only=True)
    assert data["records"][0]["topk_ids_of_layer"].shape == (LAYERS, 5, 8)  # SGLang pads k to 8 with -1
    trace = routing_dump.load_dump(dump)
    assert (trace.num_experts, trace.top_k, len(trace.layers)) == (E, TOP_K, LAYERS - 1)
    assert trace.num_steps == 4 and trace.prefill_steps == frozenset({0, 3})  # EXTEND, MIXED
    assert [[trace.layers[i][t] for i in range(2)] for t in range(4)] == expected_steps()


def test_prefill_modes_are_sglangs():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    assert routing_dump.PREFILL_MODES == {ForwardMode.EXTEND.value, ForwardMode.MIXED.value,
                                          ForwardMode.SPLIT_PREFILL.value}
    assert ForwardMode.DECODE.value not in routing_dump.PREFILL_MODES


def test_record_converts_a_dump(dump, tmp_path, capsys):
    out = tmp_path / "t.npz"
    assert cli.main(["record", "--sglang-dump", str(dump), "--out", str(out)]) == 0
    assert f"wrote {out}: 4 steps (2 prefill), 2 MoE layers, E={E}, top_k={TOP_K}" in capsys.readouterr().out
    loaded = traces.load_trace(out)
    assert [[loaded.layers[i][t] for i in range(2)] for t in range(4)] == expected_steps()
    assert loaded.prefill_steps == frozenset({0, 3})


def one_line_error(capsys, *argv: str, fragments: tuple[str, ...]) -> None:
    code = cli.main(["record", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("moepage record: "), (code, err)
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_bad_dumps_are_one_line_naming_the_file(dump, tmp_path, capsys):
    out = str(tmp_path / "t.npz")
    torch.save({"counts": torch.zeros(3)}, tmp_path / "other.pt")
    one_line_error(capsys, "--sglang-dump", str(tmp_path / "other.pt"), "--out", out,
                   fragments=("other.pt", "records", "per_token", "['counts']"))
    (tmp_path / "text.pt").write_text("not a pickle")
    one_line_error(capsys, "--sglang-dump", str(tmp_path / "text.pt"), "--out", out, fragments=("text.pt", "not a"))
    torch.save({"records": [], "last_physical_to_logical_map": P2L}, tmp_path / "empty.pt")
    one_line_error(capsys, "--sglang-dump", str(tmp_path / "empty.pt"), "--out", out,
                   fragments=("no records", "--expert-distribution-recorder-mode per_token"))
    data = torch.load(dump, weights_only=True)
    data["last_physical_to_logical_map"] = P2L[:, :8]  # physical ids 8, 9 are then outside the map
    torch.save(data, tmp_path / "short_map.pt")
    one_line_error(capsys, "--sglang-dump", str(tmp_path / "short_map.pt"), "--out", out,
                   fragments=("physical expert id 9", "8"))
    one_line_error(capsys, "--sglang-dump", str(tmp_path / "absent.pt"), "--out", out, fragments=("absent.pt",))
    one_line_error(capsys, "--sglang-dump", str(dump), "--prompts", str(dump), "--out", out,
                   fragments=("--sglang-dump", "--prompts"))
    one_line_error(capsys, "--sglang-dump", str(dump), "--out", str(tmp_path / "t.pt"), fragments=("--out", ".npz"))
    assert not Path(out).exists()


class FakeServer:
    """An HTTP server answering SGLang's recorder and ``/generate`` endpoints; ``/dump`` writes ``dump_bytes``."""

    def __init__(self, dump_dir: Path, dump_bytes: bytes, fail_generate: bool = False):
        self.calls: list[tuple[str, dict | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.calls.append((self.path, json.loads(raw) if raw else None))
                body = b"{}"
                if self.path == "/generate":
                    if fail_generate:
                        self.send_response(500)
                        self.end_headers()
                        self.wfile.write(b"out of memory")
                        return
                    body = json.dumps({"text": "x", "meta_info": {"prompt_tokens": 3, "completion_tokens": 2}})
                    body = body.encode()
                elif self.path == "/dump_expert_distribution_record":
                    (dump_dir / f"expert_distribution_recorder_{time.time()}_0.pt").write_bytes(dump_bytes)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_record_drives_a_server_and_converts_its_newest_dump(dump, tmp_path, capsys):
    server_dir = tmp_path / "server"
    server_dir.mkdir()
    stale = server_dir / "expert_distribution_recorder_1.0_0.pt"  # an earlier session's dump: not this one
    torch.save({"records": [], "last_physical_to_logical_map": P2L}, stale)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    (tmp_path / "p.txt").write_text("first prompt\nsecond prompt\n")
    server = FakeServer(server_dir, dump.read_bytes())
    out = tmp_path / "t.npz"
    try:
        code = cli.main(["record", "--sglang-url", server.url, "--prompts", str(tmp_path / "p.txt"),
                         "--dump-dir", str(server_dir), "--out", str(out), "--max-new-tokens", "3"])
    finally:
        server.close()
    _, err = capsys.readouterr()
    assert code == 0, err
    sampling = {"max_new_tokens": 3, "temperature": 0.0}
    assert server.calls == [
        ("/start_expert_distribution_record", None),
        ("/generate", {"sampling_params": sampling, "text": "first prompt"}),
        ("/generate", {"sampling_params": sampling, "text": "second prompt"}),
        ("/stop_expert_distribution_record", None),
        ("/dump_expert_distribution_record", None),
    ]
    assert "prompt 2/2: 3 tokens in, 2 generated" in err
    loaded = traces.load_trace(out)
    assert [[loaded.layers[i][t] for i in range(2)] for t in range(4)] == expected_steps()


def test_a_failed_request_stops_the_recorder_and_says_why(dump, tmp_path, capsys):
    (tmp_path / "ids.txt").write_text("1 2 3\n")
    server = FakeServer(tmp_path, dump.read_bytes(), fail_generate=True)
    try:
        one_line_error(capsys, "--sglang-url", server.url, "--token-ids", str(tmp_path / "ids.txt"),
                       "--dump-dir", str(tmp_path), "--out", str(tmp_path / "t.npz"),
                       fragments=("/generate", "HTTP 500", "out of memory"))
    finally:
        server.close()
    assert [c[0] for c in server.calls] == ["/start_expert_distribution_record", "/generate",
                                            "/stop_expert_distribution_record"]
    assert server.calls[1][1]["input_ids"] == [1, 2, 3]
    one_line_error(capsys, "--sglang-url", server.url, "--token-ids", str(tmp_path / "ids.txt"),
                   "--out", str(tmp_path / "t.npz"), fragments=("--sglang-url", "--dump-dir"))


def test_the_newest_dump_is_this_sessions_lowest_rank(tmp_path):
    from moepage.integrations.sglang.record_server import newest_dump

    now = time.time()
    for name, age in (("old_0", 3600), ("earlier_0", 60), ("new_1", 1), ("new_0", 2)):
        path = tmp_path / f"expert_distribution_recorder_{name}.pt"
        path.write_bytes(b"")
        os.utime(path, (now - age, now - age))
    assert newest_dump(tmp_path).name == "expert_distribution_recorder_new_0.pt"
    with pytest.raises(ValueError, match="no expert_distribution_recorder_.*SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"):
        newest_dump(tmp_path, since=now)  # none written since: an earlier session's dumps are not this one's
