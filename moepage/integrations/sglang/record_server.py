"""Recording a running SGLang server's routing over prompts, with SGLang's own expert distribution recorder (the
server launched with ``--expert-distribution-recorder-mode per_token``): start the recorder, send each prompt to
``/generate`` (greedy, one at a time, so a forward pass holds one prompt), stop, dump, and return the newest dump the
server wrote in ``dump_dir`` (its ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``, which this machine must see). The
standard library's ``urllib`` only."""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from ...errors import ConfigError

DUMP_GLOB = "expert_distribution_recorder_*.pt"


def _post(url: str, path: str, body: dict | None = None, timeout: float = 600.0) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        raise ConfigError(f"{url}{path}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ConfigError(f"{url}{path}: cannot reach the SGLang server: {getattr(exc, 'reason', exc)}") from None


def _rank(path: Path) -> int:
    tail = path.stem.rpartition("_")[2]
    return int(tail) if tail.isdigit() else 0


def newest_dump(dump_dir: str | os.PathLike, since: float = 0.0) -> Path:
    """The newest dump in ``dump_dir`` written at or after ``since`` (lowest rank among the newest dump's ranks)."""
    found = [p for p in Path(dump_dir).glob(DUMP_GLOB) if p.stat().st_mtime >= since]
    if not found:
        raise ConfigError(f"{dump_dir}: no {DUMP_GLOB} written by the dump; pass the server's "
                          "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR as the dump directory (default /tmp)")
    newest = max(p.stat().st_mtime for p in found)
    recent = [p for p in found if p.stat().st_mtime >= newest - 5.0]  # the ranks of one dump write within seconds
    return min(recent, key=lambda p: (_rank(p), -p.stat().st_mtime))


def record_server(url: str, prompts: Sequence[str] | Sequence[Sequence[int]], dump_dir: str | os.PathLike,
                  max_new_tokens: int = 16, progress: Callable[[str], None] | None = None) -> Path:
    """Record the server at ``url`` over ``prompts`` (texts, or token id lists) and return its dump file."""
    if not Path(dump_dir).is_dir():
        raise ConfigError(f"dump directory {dump_dir}: no such directory")
    since = time.time() - 1.0  # file times may be coarser than the clock
    _post(url, "/start_expert_distribution_record")
    try:
        for i, prompt in enumerate(prompts):
            body: dict = {"sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
            if isinstance(prompt, str):
                body["text"] = prompt
            else:
                body["input_ids"] = list(prompt)
            reply = json.loads(_post(url, "/generate", body) or b"{}")
            if progress is not None:
                meta = reply.get("meta_info", {}) if isinstance(reply, dict) else {}
                progress(f"prompt {i + 1}/{len(prompts)}: {meta.get('prompt_tokens', '?')} tokens in, "
                         f"{meta.get('completion_tokens', '?')} generated")
    except BaseException:  # a failed request must not leave the server recording
        with contextlib.suppress(ConfigError):
            _post(url, "/stop_expert_distribution_record")
        raise
    _post(url, "/stop_expert_distribution_record")
    _post(url, "/dump_expert_distribution_record")
    dump = newest_dump(dump_dir, since)
    if progress is not None:
        progress(f"server dump {dump}")
    return dump
