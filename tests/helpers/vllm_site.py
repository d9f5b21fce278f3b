"""The vLLM the vLLM tests run against, made by the tests themselves: vLLM 0.33.0's own wheel from PyPI and the few
packages it imports that the test environment lacks, installed into a folder of their own (``pip --target``, no
dependencies resolved: vLLM pins torch 2.14.0, whose CUDA wheels would replace the tests' torch 2.14.1). vLLM's
Python runs on the tests' torch; its compiled kernels need CUDA and do not run here (a torch test double stands in
for the expert kernel, ``vllm_double``). The cases run in a process of their own (``run_cases``), with this folder on
``PYTHONPATH`` and ``VLLM_TARGET_DEVICE=cpu``. Made once per machine (``MOEPAGE_TEST_CACHE``, default
``~/.cache/moepage``); a half-made folder is never used (it is made beside and renamed when complete)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

VLLM = "vllm==0.33.0"
# What vLLM 0.33.0 imports on the CPU paths the tests take that the [test] extra (SGLang's dependencies) lacks.
EXTRA = ("cbor2==6.3.0", "cachetools==8.0.2", "py-cpuinfo==9.0.0", "openai==3.63.0")


def cache_dir() -> Path:
    return Path(os.environ.get("MOEPAGE_TEST_CACHE") or Path.home() / ".cache" / "moepage")


def site() -> Path:
    """The folder holding vLLM (made on first use; pip's output is shown if it fails)."""
    name = f"{VLLM.replace('==', '-')}-site"
    done = cache_dir() / name
    if (done / ".complete").exists():
        return done
    making = cache_dir() / f"{name}.{os.getpid()}.partial"
    shutil.rmtree(making, ignore_errors=True)
    making.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--target", str(making), VLLM, *EXTRA]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        shutil.rmtree(making, ignore_errors=True)
        raise RuntimeError(f"making the vLLM test site failed ({' '.join(cmd)}):\n{result.stdout}\n{result.stderr}")
    (making / ".complete").write_text(" ".join((VLLM, *EXTRA)) + "\n")
    if not (done / ".complete").exists():
        shutil.rmtree(done, ignore_errors=True)
        making.rename(done)
    else:  # another process finished first
        shutil.rmtree(making, ignore_errors=True)
    return done


def environment(plugins: str | None = "moepage") -> dict[str, str]:
    """The environment of a process running vLLM from ``site()`` on the CPU (``plugins``: ``VLLM_PLUGINS``, None:
    every plugin installed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site()), env.get("PYTHONPATH", "")) if p)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def run_cases(path: Path, *pytest_args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    """Run the vLLM cases in ``path`` with pytest in a process of their own; returns it, output captured."""
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", str(path), *pytest_args]
    return subprocess.run(cmd, cwd=root, env=environment(), capture_output=True, text=True, timeout=timeout)
