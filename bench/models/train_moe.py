"""Train a small Qwen3-MoE model on the Python standard library's source, byte by byte, so that
moepage's prefetch work (issue 15) has a model whose routing is learned, not random.

This module owns the corpus (``corpus``: every ``*.py`` under ``sysconfig``'s stdlib, without
site-packages, in sorted order, split into train / val by a hash of the file's relative path),
the byte tokenizer (bytes 0-255, ``EOS`` between files, ``PAD`` unused), the presets and the
training loop. It writes a ``save_pretrained`` checkpoint (safetensors) that
``transformers.AutoModelForCausalLM.from_pretrained`` and
``moepage.integrations.transformers.from_pretrained`` load, ``loss.json`` (train and val curves,
config, throughput) and ``loss.png``.

    python -m bench.models.train_moe --preset tiny --out tests/data/tiny_moe          # CPU, one thread, minutes
    python -m bench.models.train_moe --preset mid --out /tmp/mid_moe                  # CPU, one thread, minutes
    python -m bench.models.train_moe --preset h200 --out /tmp/h200_moe --minutes 3    # one H200

How long the CPU presets took, and their losses: bench/RESULTS.md, 'Learned routing predictability (CPU)' (tiny) and
'Lossless expert compression: how much is there (CPU)' (mid).

The corpus differs between Python versions (3.11 here, 3.12 on the H200), so a checkpoint is
reproducible only on the same Python. Training is seeded; a run bounded by ``--minutes`` rather
than ``--steps`` stops at a wall-clock-dependent step (the step count is logged).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from bench import common

EOS, PAD = 256, 257  # byte tokens are 0..255
VOCAB = 258
VAL_EVERY = 20  # one file in 20 (by path hash) is validation

# Model shapes and run settings. tiny: 1.8 MB in bf16, minutes on one CPU core; its step budget
# binds (``minutes`` is only a safety bound), so the run is deterministic. h200: per-expert weights
# of 4.7 MB in bf16 (3 x 1024 x 768), the top_k / E ratio of Qwen3-30B-A3B (8 / 128); its time
# budget binds.
PRESETS = {
    "tiny": dict(
        model=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   num_experts=32, num_experts_per_tok=4, moe_intermediate_size=32),
        seq=256, batch=16, steps=800, minutes=20.0, lr=3e-3, warmup=50, eval_every=100, eval_batches=8,
        save_dtype="bfloat16",
    ),
    # mid: per-expert rows 32x the tiny model's (3 x 256 x 256), for measurements that depend on
    # row size (compressibility); its time and loss: bench/RESULTS.md, 'Lossless expert compression: how much is there'.
    "mid": dict(
        model=dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256),
        seq=128, batch=8, steps=400, minutes=12.0, lr=3e-3, warmup=30, eval_every=100, eval_batches=4,
        save_dtype="bfloat16",
    ),
    "h200": dict(
        model=dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                   num_experts=64, num_experts_per_tok=4, moe_intermediate_size=768),
        seq=1024, batch=32, steps=100_000, minutes=3.0, lr=1e-3, warmup=100, eval_every=100, eval_batches=16,
        save_dtype="bfloat16",
    ),
}
# Qwen3-MoE's own default coefficient: the tiny model trained with it routes about as skewed as Qwen3-30B-A3B's
# decode, and 1e-4 changed little (docs/results-history.md, 2026-11-30, 'A Qwen3-MoE with learned routing').
AUX_LOSS_COEF = 0.001


def stdlib_files() -> list[Path]:
    """The stdlib's ``*.py`` files (site-packages excluded), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]  # pruned, not filtered: it is most of the tree
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted((p for p in files if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def is_val(relpath: str) -> bool:
    # A hash of the path, not the position, so that adding a file elsewhere moves no other file.
    return zlib.crc32(relpath.encode()) % VAL_EVERY == 0


def corpus(split: str, max_bytes: int | None = None) -> np.ndarray:
    """The ``split`` ("train" or "val") as one uint16 token stream: each file's bytes, then EOS."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in stdlib_files():
        if is_val(path.relative_to(root).as_posix()) != (split == "val"):
            continue
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.uint16)
        parts += [data, np.array([EOS], dtype=np.uint16)]
        total += data.size + 1
        if max_bytes is not None and total >= max_bytes:
            break
    stream = np.concatenate(parts)
    return stream[:max_bytes] if max_bytes is not None else stream


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def make_config(preset: str, aux_coef: float = AUX_LOSS_COEF, **overrides):
    from transformers import Qwen3MoeConfig

    p = PRESETS[preset]
    cfg = dict(
        vocab_size=VOCAB, intermediate_size=4 * p["model"]["hidden_size"], max_position_embeddings=p["seq"],
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=EOS, pad_token_id=PAD,
        output_router_logits=False,  # the training loop asks for them; inference need not compute aux loss
        router_aux_loss_coef=aux_coef, norm_topk_prob=True, initializer_range=0.02,
    )
    cfg.update(p["model"])
    cfg.update(overrides)
    return Qwen3MoeConfig(**cfg)


def windows(stream: np.ndarray, seq: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``seq + 1`` tokens (inputs and next-token labels)."""
    starts = torch.randint(0, stream.size - seq - 1, (batch,), generator=gen).tolist()
    return torch.from_numpy(np.stack([stream[s : s + seq + 1] for s in starts]).astype(np.int64))


def val_windows(stream: np.ndarray, seq: int, count: int) -> torch.Tensor:
    """``count`` fixed, evenly spaced windows of the validation stream (the same at every eval)."""
    starts = np.linspace(0, stream.size - seq - 2, count).astype(np.int64)
    return torch.from_numpy(np.stack([stream[s : s + seq + 1] for s in starts]).astype(np.int64))


def lr_at(progress: float, step: int, peak: float, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine to 10 % of peak as progress goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


@torch.no_grad()
def evaluate(model, batches: torch.Tensor, batch: int, device, amp: bool) -> float:
    """Mean next-token cross-entropy (nats per byte) over the fixed validation windows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, batches.shape[0], batch):
        x = batches[i : i + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1), reduction="sum")
        total, count = total + float(loss), count + x[:, 1:].numel()
    model.train()
    return total / count


class MasterWeights:
    """bf16 model weights with fp32 master copies and AdamW state.

    On the GPU the model runs in bf16 so that HF's ``grouped_mm`` experts get bf16 weights (its
    grouped GEMM is not autocast-aware and would run in fp32 against fp32 weights); the
    update is applied to fp32 masters so that small steps are not lost to bf16 rounding."""

    def __init__(self, model, lr: float, fused: bool):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)

    def step(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.float() if p.grad is not None else None
            p.grad = None
        torch.nn.utils.clip_grad_norm_(self.masters, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)


def plot(log: dict, path: Path) -> None:
    fig, (ax,) = common.figure(1, (6, 4))
    ax.plot([r["step"] for r in log["train"]], [r["loss"] for r in log["train"]], label="train (per step)", alpha=0.6)
    ax.plot([r["step"] for r in log["val"]], [r["loss"] for r in log["val"]], "o-", label="val")
    ax.set(xlabel="step", ylabel="cross-entropy (nats / byte)",
           title=f"{log['preset']}: {log['params_total'] / 1e6:.1f} M params, {log['tokens'] / 1e6:.1f} M tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    common.save(fig, path)


def train(preset: str, out: Path, steps: int | None = None, minutes: float | None = None, seed: int = 0,
          device: str | None = None, threads: int = 1, aux_coef: float = AUX_LOSS_COEF) -> dict:
    from transformers import Qwen3MoeForCausalLM

    p = PRESETS[preset]
    steps = steps if steps is not None else p["steps"]
    minutes = minutes if minutes is not None else p["minutes"]
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = dev.type == "cuda"
    if not gpu:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    config = make_config(preset, aux_coef)
    # grouped_mm: one grouped GEMM per projection on the GPU, and faster than "eager" on CPU too
    # (docs/results-history.md, 'Figures once stated in bench code comments').
    config._experts_implementation = "grouped_mm"
    with dev:  # initialised where it trains: a CPU init of the h200 preset's 1.2 B parameters takes long
        model = Qwen3MoeForCausalLM(config)
    if gpu:
        model.to(torch.bfloat16)
    model.train()
    opt = MasterWeights(model, p["lr"], fused=gpu)
    train_stream, val_stream = corpus("train"), corpus("val")
    val_batches = val_windows(val_stream, p["seq"], p["eval_batches"] * p["batch"])
    gen = torch.Generator().manual_seed(seed)
    n_params = sum(t.numel() for t in model.parameters())
    expert_params = sum(t.numel() for n, t in model.named_parameters() if ".experts." in n)
    log = dict(preset=preset, seed=seed, device=str(torch.cuda.get_device_name(dev) if gpu else "cpu"),
               torch=torch.__version__, config=config.to_dict(), params_total=n_params, params_experts=expert_params,
               train_bytes=int(train_stream.size), val_bytes=int(val_stream.size), seq=p["seq"], batch=p["batch"],
               train=[], val=[], tokens=0)
    print(f"{preset}: {n_params / 1e6:.2f} M params ({expert_params / 1e6:.2f} M in experts), "
          f"train {train_stream.size / 1e6:.1f} MB, val {val_stream.size / 1e6:.1f} MB, device {log['device']}",
          flush=True)

    start, step = time.perf_counter(), 0
    while True:
        elapsed = time.perf_counter() - start
        # The schedule follows whichever budget runs out first: steps or wall-clock minutes.
        progress = max(step / steps, elapsed / (60 * minutes))
        if step % p["eval_every"] == 0 or progress >= 1:
            val = evaluate(model, val_batches, p["batch"], dev, amp=gpu)
            log["val"].append(dict(step=step, loss=val, seconds=elapsed))
            tps = log["tokens"] / max(elapsed, 1e-9)
            print(f"step {step:6d}  {elapsed:7.1f} s  val {val:.4f}  {tps:,.0f} tok/s", flush=True)
        if progress >= 1:
            break
        x = windows(train_stream, p["seq"], p["batch"], gen).to(dev, non_blocking=True)
        res = model(input_ids=x[:, :-1], output_router_logits=True)
        # Our own loss on pre-shifted windows (HF's would shift the labels again and drop a token);
        # the aux loss is HF's Switch-style load-balancing loss over all layers' router logits.
        lm = torch.nn.functional.cross_entropy(res.logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        (lm + config.router_aux_loss_coef * res.aux_loss).backward()
        opt.step(lr_at(progress, step, p["lr"], p["warmup"]))
        lm = lm.item()
        log["train"].append(dict(step=step, loss=lm, aux=res.aux_loss.detach().item()))
        log["tokens"] += x[:, :-1].numel()
        step += 1
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    log.update(steps=step, seconds=seconds, tokens_per_s=log["tokens"] / seconds)  # evals included

    out.mkdir(parents=True, exist_ok=True)
    model.eval().to(getattr(torch, p["save_dtype"]))
    model.config.output_router_logits = False
    model.save_pretrained(out)
    # The checkpoint holds rounded weights: its own val loss is the figure that describes it.
    log["val_saved"] = evaluate(model, val_batches, p["batch"], dev, amp=False)
    (out / "loss.json").write_text(json.dumps(log, indent=1))
    plot(log, out / "loss.png")
    print(f"saved {out}: val {log['val'][-1]['loss']:.4f} (as saved in {p['save_dtype']}: {log['val_saved']:.4f}), "
          f"{step} steps, {log['tokens'] / 1e6:.1f} M tokens, {log['tokens_per_s']:,.0f} tok/s", flush=True)
    return log


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, help="step budget (default: the preset's)")
    ap.add_argument("--minutes", type=float, help="wall-clock budget of the training loop (default: the preset's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--aux-coef", type=float, default=AUX_LOSS_COEF, help="router load-balancing loss coefficient")
    ap.add_argument("--device", help="default: cuda if available, else cpu")
    # One thread by default: on a shared machine, OpenMP barriers stall every step while another process holds a
    # core (docs/results-history.md, 'Figures once stated in bench code comments').
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (CPU runs only)")
    args = ap.parse_args(argv)
    train(args.preset, args.out, args.steps, args.minutes, args.seed, args.device, args.threads, args.aux_coef)


if __name__ == "__main__":
    main()
