"""How skewed and how predictable the routing of a trained Qwen3-MoE checkpoint is (issue 15).

This module owns recording a model's routing on held-out text (``record``: per MoE layer the
experts each token is routed to, the residual stream entering each layer and each layer's router
input), the statistics computed from that record, and the report (JSON, Markdown, PNG, and the
routing as a ``moepage trace`` simple-npz trace).

- **popularity** per layer: sorted expert frequency, entropy against uniform (log2 E), the share
  of routed entries taken by the top 25 % of experts (uniform: 0.25).
- **co-activation** L -> L+1: P(expert j at L+1 | expert i at L); its conditional entropy against
  the entropy of L+1's marginal, and the mass of its top-k entries (uniform: k / E).
- **recall d layers ahead**: layer T's router (its ``mlp.gate`` weight, softmax, top-m: exactly how
  the model routes) applied to a state a prefetcher has d layers early: ``raw`` is the residual
  stream *leaving* layer T-d as is, ``post_ln`` that state after layer T's
  ``post_attention_layernorm`` (what the router normally sees), and ``moe_in`` the hidden state
  *entering* layer T-d's experts module (what layer T-d's own router saw: its post-attention,
  post-layernorm input), which is what ``moepage.wrap(..., prefetch=True)`` feeds layer T's
  router while layer T-d's experts run (d = 1). recall = |predicted top-m ∩ actual
  top-k| / k, averaged over tokens; m = k and m = 2k. Baselines: chance (m / E) and always
  predicting the layer's m most popular experts (counted on the same tokens: in-sample).
- **temporal locality** per layer: the fraction of a token's experts that the next token uses too.

    python -m bench.analysis.routing_analysis tests/data/tiny_moe --out tests/data/tiny_moe/routing
    python -m bench.analysis.routing_analysis CKPT --random-init ...     # same config, random weights

The text is teacher-forced held-out source (the val split of ``bench.models.train_moe.corpus``), one
step per token, windows one after another: a decode-like trace of real text, not of generation.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench import common
from bench.common import table
from bench.models.train_moe import corpus, val_windows

LOOKAHEADS = (1, 2, 3)
VARIANTS = ("raw", "post_ln", "moe_in")


@dataclass
class Record:
    ids: np.ndarray  # [layers, windows, seq, k] routed experts, in router-rank order
    entering: list[torch.Tensor]  # entering[l]: [tokens, H] residual stream entering layer l (l = 0..L)
    router_in: list[torch.Tensor]  # router_in[l]: [tokens, H] what layer l's router saw
    num_experts: int
    top_k: int


def load(path: str, random_init: bool = False, seed: int = 0, device: str = "cpu"):
    """The checkpoint in fp32 (or a fresh random model of its config), in eval mode, on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if random_init:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device).eval()


def sample(windows: int = 32, seq: int = 256) -> torch.Tensor:
    """``windows`` fixed, evenly spaced windows of ``seq`` tokens of the held-out (val) split."""
    return val_windows(corpus("val"), seq - 1, windows)


@torch.no_grad()
def record(model, input_ids: torch.Tensor) -> Record:
    """Run ``model`` on ``input_ids [windows, seq]`` and record every layer's routing and inputs."""
    layers = model.model.layers
    entering: list[torch.Tensor] = [None] * (len(layers) + 1)
    routed: list[torch.Tensor] = [None] * len(layers)
    router_in: list[torch.Tensor] = [None] * len(layers)

    def enter(i):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            entering[i] = h.reshape(-1, h.shape[-1]).clone()
        return hook

    def leave(module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        entering[len(layers)] = h.reshape(-1, h.shape[-1]).clone()

    def route(i):
        def hook(module, args, output):
            router_in[i] = args[0].reshape(-1, args[0].shape[-1]).clone()
            routed[i] = output[2]  # (router_logits, router_scores, router_indices)
        return hook

    handles = [layer.register_forward_pre_hook(enter(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles += [layer.mlp.gate.register_forward_hook(route(i)) for i, layer in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(leave))
    try:
        model(input_ids=input_ids.to(model.device))
    finally:
        for h in handles:
            h.remove()
    w, s = input_ids.shape
    ids = torch.stack(routed).reshape(len(layers), w, s, -1).cpu().numpy()
    return Record(ids, entering, router_in, model.config.num_experts, model.config.num_experts_per_tok)


def router_topk(layer, x: torch.Tensor, m: int) -> torch.Tensor:
    """Layer's router on ``x [T, H]``: linear, softmax in fp32, top-m (the model's own steps)."""
    logits = torch.nn.functional.linear(x, layer.mlp.gate.weight)
    return torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), m, dim=-1).indices


def overlap(pred: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """Per token: |pred ∩ actual| / |actual| (``pred [T, m]``, ``actual [T, k]``)."""
    return (pred[:, :, None] == actual[:, None, :]).any(1).sum(-1) / actual.shape[1]


def entropy_bits(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def popularity(ids: np.ndarray, e: int) -> list[dict]:
    """Per layer: sorted frequency, entropy vs uniform, top-25 % share (``ids [L, ..., k]``)."""
    out = []
    for layer in ids.reshape(ids.shape[0], -1):
        freq = np.bincount(layer, minlength=e) / layer.size
        srt = np.sort(freq)[::-1]
        out.append(dict(sorted_freq=srt.tolist(), entropy_bits=entropy_bits(freq), uniform_bits=math.log2(e),
                        top25_share=float(srt[: max(1, e // 4)].sum()), max_share=float(srt[0]),
                        unused=int((freq == 0).sum())))
    return out


def coactivation(ids: np.ndarray, e: int) -> list[dict]:
    """For each L -> L+1: counts of (expert i at L, expert j at L+1) over tokens, and how
    concentrated P(j | i) is."""
    k = ids.shape[-1]
    flat = ids.reshape(ids.shape[0], -1, k)
    out = []
    for l in range(flat.shape[0] - 1):
        a, b = flat[l], flat[l + 1]
        counts = np.zeros((e, e))
        np.add.at(counts, (np.repeat(a, k, axis=1).ravel(), np.tile(b, (1, k)).ravel()), 1)
        rows = counts.sum(1)
        p_i = rows / rows.sum()
        cond = counts / np.maximum(rows[:, None], 1)
        marginal = counts.sum(0) / counts.sum()
        h_cond = float(sum(p_i[i] * entropy_bits(cond[i]) for i in range(e) if rows[i]))
        topk_mass = float(sum(p_i[i] * np.sort(cond[i])[::-1][:k].sum() for i in range(e) if rows[i]))
        out.append(dict(layers=f"{l}->{l + 1}", h_next_bits=entropy_bits(marginal), h_next_given_prev_bits=h_cond,
                        topk_mass=topk_mass, marginal_topk_mass=float(np.sort(marginal)[::-1][:k].sum()),
                        chance_topk_mass=k / e, p_prev=p_i.tolist(), p_next=marginal.tolist(), cond=cond.tolist()))
    return out


@torch.no_grad()
def recall(model, rec: Record) -> list[dict]:
    """Recall of layer T's routing predicted d layers ahead, for every variant and set size."""
    layers, k, e = model.model.layers, rec.top_k, rec.num_experts
    n = len(layers)
    actual = rec.ids.reshape(n, -1, k)
    rows = []
    for d in LOOKAHEADS:
        for t in range(d, n):
            leaving = rec.entering[t - d + 1]  # the output of layer t - d
            for variant in VARIANTS:
                if variant == "moe_in":  # what layer t - d's experts (and router) got
                    x = rec.router_in[t - d]
                else:
                    x = layers[t].post_attention_layernorm(leaving) if variant == "post_ln" else leaving
                pred = router_topk(layers[t], x, 2 * k).cpu().numpy()  # top-k is the first k of top-2k
                for m in (k, 2 * k):
                    r = overlap(pred[:, :m], actual[t])
                    rows.append(dict(ahead=d, target=t, variant=variant, m=m, recall=float(r.mean())))
    for t in range(n):  # baselines: chance, and the layer's m most popular experts every time
        top = np.argsort(-np.bincount(actual[t].ravel(), minlength=e), kind="stable")
        for m in (k, 2 * k):
            pop = overlap(np.broadcast_to(top[:m], (actual.shape[1], m)), actual[t])
            rows.append(dict(ahead=0, target=t, variant="popular", m=m, recall=float(pop.mean())))
            rows.append(dict(ahead=0, target=t, variant="chance", m=m, recall=m / e))
    return rows


def temporal(ids: np.ndarray) -> list[float]:
    """Per layer: mean fraction of a token's experts also routed for the next token (same window)."""
    a, b = ids[:, :, :-1], ids[:, :, 1:]  # [L, W, S-1, k]
    shared = (a[..., :, None] == b[..., None, :]).any(-1).sum(-1) / ids.shape[-1]
    return shared.reshape(ids.shape[0], -1).mean(1).tolist()


def check_reproduces(model, rec: Record) -> None:
    """``router_topk`` on each layer's recorded router input must give the model's own routing, so
    that the predictions above are made exactly as the model routes."""
    for t, layer in enumerate(model.model.layers):
        mine = router_topk(layer, rec.router_in[t], rec.top_k).cpu().numpy()
        if not np.array_equal(mine, rec.ids[t].reshape(mine.shape)):
            raise AssertionError(f"layer {t}: the router replica does not reproduce the model's routing")


def analyse(model, input_ids: torch.Tensor) -> dict:
    rec = record(model, input_ids)
    check_reproduces(model, rec)
    e, k = rec.num_experts, rec.top_k
    return dict(num_experts=e, top_k=k, tokens=int(input_ids.numel()), layers=len(model.model.layers),
                popularity=popularity(rec.ids, e), coactivation=coactivation(rec.ids, e),
                recall=recall(model, rec), temporal=temporal(rec.ids), record=rec)


def mean_recall(rows: list[dict], ahead: int, variant: str, m: int, target: int | None = None) -> float:
    sel = [r["recall"] for r in rows if r["ahead"] == ahead and r["variant"] == variant and r["m"] == m
           and (target is None or r["target"] == target)]
    return float(np.mean(sel)) if sel else float("nan")


def markdown(res: dict, title: str) -> str:
    e, k, n = res["num_experts"], res["top_k"], res["layers"]
    lines = [f"### {title}", "", f"{res['tokens']} held-out tokens, E = {e}, top-k = {k}, {n} layers; "
             f"chance recall k/E = {k / e:.3f} (2k/E = {2 * k / e:.3f}).", "",
             "**Popularity and temporal locality** (uniform: entropy log2 E = "
             f"{math.log2(e):.2f} bits, top-25 % share 0.25, repeat k/E = {k / e:.3f})", "",
             table([{"layer": l, "entropy bits": f"{p['entropy_bits']:.2f}",
                     "/ uniform": p["entropy_bits"] / p["uniform_bits"], "top-25 % share": p["top25_share"],
                     "top expert share": p["max_share"], "unused": p["unused"], "repeat next token": t}
                    for l, (p, t) in enumerate(zip(res["popularity"], res["temporal"]))]),
             "", f"**Co-activation L → L+1** (P(j at L+1 | i at L); top-k mass: share of P(· | i) in its k largest "
             f"entries, weighted by P(i); uniform {k / e:.3f})", "",
             table([{"layers": c["layers"], "H(next) bits": f"{c['h_next_bits']:.2f}",
                     "H(next \\| prev) bits": f"{c['h_next_given_prev_bits']:.2f}", "top-k mass": c["topk_mass"],
                     "top-k mass of marginal": c["marginal_topk_mass"]} for c in res["coactivation"]]),
             "", "**Recall of layer T's experts predicted d layers ahead**: layer T's router on the output of layer "
             "T-d (raw: as is; post_ln: after layer T's post_attention_layernorm) or on the input of layer T-d's "
             "experts (moe_in: what layer T-d's router saw; the prefetch predictor at d = 1), top-k or top-2k "
             "predicted; `popular`: the layer's k (2k) most frequent experts on these same tokens (in-sample)", ""]
    rows = res["recall"]
    predictors = [(d, v) for d in LOOKAHEADS if d < n for v in VARIANTS] + [(0, "popular"), (0, "chance")]
    lines.append(table([{"predictor": f"{d} ahead, {v}" if d else v, "set": "top-k" if m == k else "top-2k",
                         **{f"layer {t}": mean_recall(rows, d, v, m, t) for t in range(n)},
                         "mean": mean_recall(rows, d, v, m)} for d, v in predictors for m in (k, 2 * k)],
                       cell=lambda c: "–" if isinstance(c, float) and math.isnan(c) else common.plain(c)))
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path, title: str) -> None:
    e, k, n = res["num_experts"], res["top_k"], res["layers"]
    fig, ax = common.figure(3, (5, 4.2))
    for l, p in enumerate(res["popularity"]):
        ax[0].plot(range(1, e + 1), p["sorted_freq"], marker=".", label=f"layer {l}")
    ax[0].axhline(1 / e, color="gray", ls="--", label="uniform")
    ax[0].set(xlabel="expert rank", ylabel="share of routed entries", title="popularity (sorted)")
    ax[0].legend(fontsize=8)
    series = [(d, v) for d in LOOKAHEADS for v in VARIANTS] + [(0, "popular")]
    common.bars(ax[1], [(f"{d} ahead, {v}" if d else "most popular k",  # NaN (no layer d ahead): no bar
                         [mean_recall(res["recall"], d, v, k, t) for t in range(n)]) for d, v in series])
    ax[1].axhline(k / e, color="gray", ls="--", label="chance k/E")
    ax[1].axhline(0.8, color="red", ls=":", label="issue 15 goal")
    ax[1].set(xlabel="target layer", ylabel="recall (top-k predicted)", title="recall of the next layers' experts",
              xticks=range(n), ylim=(0, 1.25))
    ax[1].legend(fontsize=7, loc="upper left", ncol=3)
    c = res["coactivation"][0]
    rows_by, cols_by = (np.argsort(-np.array(c["p_prev"]), kind="stable"),
                        np.argsort(-np.array(c["p_next"]), kind="stable"))
    im = ax[2].imshow(np.array(c["cond"])[np.ix_(rows_by, cols_by)], aspect="auto", cmap="viridis")
    ax[2].set(xlabel="expert at layer 1 (by popularity)", ylabel="expert at layer 0 (by popularity)",
              title="P(expert at 1 | expert at 0)")
    fig.colorbar(im, ax=ax[2])
    common.save(fig, path, title)


def report(res: dict, out: Path, title: str, trace: bool = True) -> None:
    """Write ``routing.json``, ``routing.md``, ``routing.png`` and ``trace.npz`` under ``out``."""
    from moepage.planning.traces import save_simple

    out.mkdir(parents=True, exist_ok=True)
    rec = res["record"]
    data = {key: v for key, v in res.items() if key != "record"}
    data["coactivation"] = [{key: v for key, v in c.items() if key != "cond"} for c in res["coactivation"]]
    (out / "routing.json").write_text(json.dumps(data, indent=1))
    (out / "routing.md").write_text(markdown(res, title))
    plot(res, out / "routing.png", title)
    if trace:  # one step per token, windows one after another: [steps, layers, k]
        steps = rec.ids.reshape(rec.ids.shape[0], -1, rec.top_k).transpose(1, 0, 2)
        save_simple(out / "trace.npz", steps.astype(np.int16), rec.num_experts, rec.top_k)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--windows", type=int, default=32, help="held-out windows (evenly spaced over the val split)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per window")
    ap.add_argument("--random-init", action="store_true", help="analyse a random model of the checkpoint's config")
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load(args.checkpoint, args.random_init, device=args.device)
    res = analyse(model, sample(args.windows, args.seq))
    title = f"{Path(args.checkpoint).name}{' (random init)' if args.random_init else ''}"
    report(res, args.out, title, trace=not args.no_trace)
    print((args.out / "routing.md").read_text())


if __name__ == "__main__":
    main()
