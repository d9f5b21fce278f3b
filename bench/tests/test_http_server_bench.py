"""The HTTP server benchmark's CPU-checkable parts: its tokenizer round-trips text and ids, its
launch flags are SGLang's, and the report compares texts with the unpaged server's."""

from __future__ import annotations

import pytest

from bench.serving import http_server as H


def test_tokenizer_round_trips_words_and_ids(tmp_path):
    import tokenizers  # noqa: F401  (the [test] extra installs it)
    import transformers
    H.write_tokenizer(tmp_path, 1024)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = H.prompts([40], 1024, seed=3)[0]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == [int(w[1:]) for w in text.split()]
    assert tok.decode(ids) == text


@pytest.mark.parametrize("mode", H.MODES)
def test_launch_flags_parse_as_sglang_server_args(tmp_path, mode):
    import sglang  # noqa: F401  (the [test] extra installs it)
    from sglang.srt.server_args import prepare_server_args

    argv = H.server_argv(mode, tmp_path, 30100, 32)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    args = prepare_server_args(argv[3:])
    assert args.enable_deterministic_inference and not args.skip_tokenizer_init
    assert bool(args.enable_paged_experts) == (mode != "unpaged")
    if mode != "unpaged":
        assert args.paged_experts_num_resident == 32


def test_report_counts_equal_texts_and_ratios():
    one = dict(requests=8, ttft_ms=10.0, ttft_p90_ms=12.0, tpot_ms=2.0, tpot_p90_ms=3.0)
    lat = {str(c): one for c in H.CONCURRENCY}
    results = {
        "unpaged": dict(k=None, sequential=["a", "b"], stream=["a", "b"], concurrent=["a", "b"], latency=lat),
        "moepage": dict(k=32, sequential=["a", "b"], stream=["a", "x"], concurrent=["a", "b"],
                        latency={c: {**v, "tpot_ms": 1.0} for c, v in lat.items()}),
        "builtin": dict(k=32, sequential=["a", "c"], stream=["a", "c"], concurrent=["a", "b"], latency=lat),
    }
    text = H.report(results)
    assert "| moepage | 32 | 2/2 | 1/2 | 2/2 |" in text and "| builtin | 32 | 1/2 | 2/2 | 2/2 |" in text
    assert "| 8 | moepage / built-in | 1.00 | 0.50 |" in text


class _FakeCompletions:
    """A stand-in for SGLang's /v1/completions: the answer is the prompt's words reversed, cut to max_tokens."""

    @staticmethod
    def serve():
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert body["temperature"] == 0 and body["ignore_eos"] is True
                words = body["prompt"].split()[::-1][: body["max_tokens"]]
                base = dict(id="x", object="text_completion", created=0, model="default")
                if not body.get("stream"):
                    out = dict(base, choices=[dict(index=0, text=" ".join(words), finish_reason="length")])
                    data = json.dumps(out).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i, w in enumerate(words):
                    chunk = dict(base, choices=[dict(index=0, text=(" " if i else "") + w, finish_reason=None)])
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                usage = dict(prompt_tokens=1, completion_tokens=len(words), total_tokens=1 + len(words))
                self.wfile.write(f"data: {json.dumps(dict(base, choices=[], usage=usage))}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # the client opens up to 32 connections at once

        server = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


def test_client_phases_against_a_fake_completions_server():
    import openai  # noqa: F401  (the [test] extra installs it)
    server = _FakeCompletions.serve()
    try:
        out = H.client_phases(server.server_address[1], 1024)
    finally:
        server.shutdown()
    expected = [" ".join(p.split()[::-1][: H.NEW_TOKENS]) for p in H.prompts(H.LENGTHS, 1024, seed=1)]
    assert out["sequential"] == expected and out["stream"] == expected and out["concurrent"] == expected
    assert set(out["latency"]) == {str(c) for c in H.CONCURRENCY}
    assert all(s["requests"] == max(8, 2 * int(c)) and s["tpot_ms"] >= 0 for c, s in out["latency"].items())
