"""The report of ``sglang_engine.py``: tables and a plot from the run results in one directory.

``write_report(DIR)`` reads every ``DIR/RUN.json`` and writes ``DIR/REPORT.md`` and
``DIR/sglang_engine.png``; it returns the short summary table printed at the end of a call.

- Correctness: each run's greedy tokens against its unpaged reference (same model, same prefill
  graph mode; the other mode's, marked, when that one is missing): outputs equal per phase and the
  first difference (prompt, position, reference token, token).
- Diversity: distinct tokens per output and routed experts per layer and step.
- Throughput per batch size: decode tokens/s = (new tokens - one per prompt) / (full pass -
  prefill-only pass), prefill tokens/s, decode hit rate and bytes paged per decode token (the full
  pass's counters minus the prefill-only pass's), the physics bound (unpaged decode time + decode
  bytes paged / the run's pinned 1 GiB memcpy bandwidth), moepage / built-in at equal K and, where the
  model has one, a paged run / SGLang's whole-parameter offload (``--cpu-offload-gb``) at equal GPU memory.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench import common
from bench.common import Goal, bound_ms
from bench.serving import step_profile

CORRECTNESS_PHASES = ("batch", "sequential", "concurrent")
VS_BUILTIN = Goal(">=", 1.0)  # moepage's decode tokens/s over the built-in's, at equal K


def load(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json"))}


def compare(ref: list[list[int]] | None, got: list[list[int]] | None) -> dict | None:
    """Outputs equal, and the first difference as (prompt, position, reference token, token)."""
    if ref is None or got is None:
        return None
    first = None
    equal = 0
    for i, (a, b) in enumerate(zip(ref, got)):
        if a == b:
            equal += 1
        elif first is None:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first = (i, pos, a[pos] if pos < len(a) else None, b[pos] if pos < len(b) else None)
    return dict(equal=equal, total=max(len(ref), len(got)), first=first)


def reference_of(model: str, prefill: str, decode: str = "full", deterministic: bool = False) -> str:
    """The unpaged run whose tokens a run of ``model`` with these CUDA-graph backends (and deterministic inference)
    must reproduce."""
    graphs = {("breakable", "full"): "", ("disabled", "full"): "-nopg", ("breakable", "disabled"): "-eagerdecode"}.get(
        (prefill, decode), "-nograph")
    return f"{model}-unpaged{graphs}{'-det' if deterministic else ''}"


def _ref(results: dict, name: str) -> tuple[str | None, bool]:
    """The reference run of ``name`` (and whether it is the other prefill mode's)."""
    spec = results[name]["spec"]
    decode = spec.get("decode", "full")
    det = spec.get("deterministic", False)
    want = reference_of(spec["model"], spec["prefill"], decode, det)
    other = reference_of(spec["model"], "breakable" if spec["prefill"] == "disabled" else "disabled", decode, det)
    for cand, swapped in ((want, False), (other, True)):
        if cand in results and results[cand].get("phases"):
            return cand, swapped
    return None, False


def _outputs(result: dict, phase: str, key: str = "outputs"):
    return (result.get("phases", {}).get(phase) or {}).get(key)


def _fmt_cmp(c: dict | None) -> str:
    if c is None:
        return "–"
    s = f"{c['equal']}/{c['total']}"
    if c["first"] is not None:
        s += " (first diff: prompt {}, token {}: {} vs {})".format(*c["first"])
    return s


def batch_vs_sequential(result: dict) -> dict | None:
    """A run's own batch-shape noise: its batch outputs against its sequential ones cut to their lengths (greedy over
    the same prompts: 16 in one batch, then one at a time)."""
    batch, seq = _outputs(result, "batch"), _outputs(result, "sequential")
    if batch is None or seq is None:
        return None
    return compare(batch, [s[: len(b)] for s, b in zip(seq, batch)])


def correctness_rows(results: dict) -> list[dict]:
    rows = []
    for name, r in results.items():
        spec = r["spec"]
        ref, swapped = _ref(results, name)
        row = dict(run=name, status=r.get("status"), K=spec["k"] or "–", prefill=spec["prefill"],
                   reference=(ref or "–") + (" (other prefill mode)" if swapped else ""))
        for phase in CORRECTNESS_PHASES:
            if spec["impl"] == "unpaged" and ref == name:
                row[phase] = "reference" if _outputs(r, phase) is not None else "–"
                continue
            want = _outputs(results[ref], phase) if ref else None
            if phase == "sequential" and want and spec.get("new_tokens"):  # fewer new tokens: greedy's prefix
                want = [w[: spec["new_tokens"]] for w in want]
            row[phase] = _fmt_cmp(compare(want, _outputs(r, phase)))
        row["concurrent, same engine twice"] = _fmt_cmp(compare(_outputs(r, "concurrent"),
                                                                _outputs(r, "concurrent", "outputs_b")))
        row["batch vs sequential, same engine"] = _fmt_cmp(batch_vs_sequential(r))
        rows.append(row)
    return rows


def diversity_rows(results: dict) -> list[dict]:
    rows = []
    for name, r in results.items():
        batch = (r.get("phases") or {}).get("batch")
        if not batch:
            continue
        distinct = [len(set(o)) for o in batch["outputs"]]
        lengths = [len(o) for o in batch["outputs"]]
        st = batch.get("stats")
        rows.append(dict(
            run=name,
            distinct_tokens_per_output=(f"{sum(distinct) / len(distinct):.1f} (min {min(distinct)}) "
                                        f"of {sum(lengths) / len(lengths):.0f}"),
            experts_per_layer_step=(f"{(st['hits'] + st['misses']) / st['steps']:.1f}" if st and st["steps"] else "–"),
            hit_rate=(f"{st['hits'] / (st['hits'] + st['misses']):.1%}" if st and st["hits"] + st["misses"] else "–"),
        ))
    return rows


def _decode(tp: dict) -> dict:
    """Decode figures of one batch size's throughput entry."""
    b = tp["batch"]
    decode_s = max(tp["total_s"] - tp["prefill_s"], 1e-9)
    tokens = tp["new_tokens"] - b
    out = dict(decode_s=decode_s, decode_tokens=tokens, decode_tok_s=tokens / decode_s,
               prefill_tok_s=tp["prompt_tokens"] / tp["prefill_s"])
    sp, st = tp.get("stats_prefill"), tp.get("stats_total")
    if sp and st:
        hits, misses = st["hits"] - sp["hits"], st["misses"] - sp["misses"]
        out.update(hit_rate=hits / (hits + misses) if hits + misses else None,
                   bytes_paged=st["bytes_paged"] - sp["bytes_paged"],
                   bytes_per_token=(st["bytes_paged"] - sp["bytes_paged"]) / tokens if tokens else None)
        if st.get("host_hits", 0) + st.get("host_misses", 0):  # a disk tier: how much of the page-in came from disk
            h, m = st["host_hits"] - sp.get("host_hits", 0), st["host_misses"] - sp.get("host_misses", 0)
            out.update(host_hit_rate=h / (h + m) if h + m else None,
                       disk_bytes=st["disk_bytes"] - sp.get("disk_bytes", 0))
    return out


def _bandwidth(results: dict, name: str) -> float | None:
    gbs = results[name].get("memcpy_gbs")
    if gbs:
        return gbs
    others = [r["memcpy_gbs"] for r in results.values() if r.get("memcpy_gbs")]
    return sum(others) / len(others) if others else None


def _peer(results: dict, name: str, impl: str, compress: bool = False, host_budget: str | None = None) -> str | None:
    """The run with the same model, K and prefill mode served by ``impl`` (with coded host rows or not, over a disk
    tier of ``host_budget`` or none; moepage's with the same policy; no restart), with the same decode graphs where
    there is one."""
    s = results[name]["spec"]
    found = [other for other, r in results.items() if (t := r["spec"])["impl"] == impl
             and (t["model"], t["k"], t["prefill"]) == (s["model"], s["k"], s["prefill"])
             and bool(t.get("compress")) == compress and not t.get("offload_gb")
             and t.get("host_budget") == host_budget and not t.get("restart_of")
             and (impl != "moepage" or t.get("policy") == s.get("policy"))]
    same = [o for o in found if results[o]["spec"].get("decode", "full") == s.get("decode", "full")]
    return (same or found or [None])[0]


def _offload(results: dict, name: str) -> str | None:
    """SGLang's whole-parameter offload run of the same model and prefill mode (the alternative at equal memory)."""
    s = results[name]["spec"]
    return next((other for other, r in results.items() if r["spec"].get("offload_gb")
                 and (r["spec"]["model"], r["spec"]["prefill"]) == (s["model"], s["prefill"])), None)


def _batches(result: dict | None) -> dict:
    """The throughput phase's entries by batch size (as strings), or {}."""
    return (((result or {}).get("phases") or {}).get("tput") or {}).get("batches") or {}


def throughput_rows(results: dict) -> list[dict]:
    rows = []
    for name, r in results.items():
        tput = _batches(r)
        if not tput:
            continue
        ref, _ = _ref(results, name)
        ref_tput = _batches(results.get(ref))
        builtin = _peer(results, name, "builtin") if r["spec"]["impl"] == "moepage" else None
        b_tput = _batches(results.get(builtin))
        raw = (_peer(results, name, "moepage", host_budget=r["spec"].get("host_budget"))
               if r["spec"].get("compress") else None)  # its raw-rows twin (over the same disk tier, if any)
        raw_tput = _batches(results.get(raw))
        offload = _offload(results, name) if r["spec"]["impl"] != "unpaged" else None
        o_tput = _batches(results.get(offload))
        host_only = _peer(results, name, "moepage") if r["spec"].get("host_budget") else None  # its all-host twin
        h_tput = _batches(results.get(host_only))
        gbs = _bandwidth(results, name)
        for key, tp in sorted(tput.items(), key=lambda kv: int(kv[0])):
            d = _decode(tp)
            row = dict(run=name, batch=tp["batch"], decode_tok_s=d["decode_tok_s"], prefill_tok_s=d["prefill_tok_s"],
                       hit_rate=d.get("hit_rate"), bytes_per_decode_token=d.get("bytes_per_token"))
            if key in ref_tput and d.get("bytes_paged") is not None and gbs:
                unpaged = _decode(ref_tput[key])  # its decode time per token, times this run's tokens
                bound = bound_ms(unpaged["decode_s"] * 1e3 * d["decode_tokens"] / unpaged["decode_tokens"],
                                 d["bytes_paged"], gbs)
                if d.get("disk_bytes") and r.get("disk_gbs"):  # plus the disk's reads at its measured speed
                    bound += d["disk_bytes"] / (r["disk_gbs"] * 1e6)
                row["bound_tok_s"] = d["decode_tokens"] * 1e3 / bound
                row["of_bound"] = d["decode_tok_s"] / row["bound_tok_s"]
            if "host_hit_rate" in d:
                row["host_hit_rate"] = d["host_hit_rate"]
                row["disk_bytes_per_token"] = d["disk_bytes"] / d["decode_tokens"] if d["decode_tokens"] else None
            if key in h_tput:
                row["vs_host_only"] = d["decode_tok_s"] / _decode(h_tput[key])["decode_tok_s"]
            if key in b_tput:
                row["vs_builtin"] = d["decode_tok_s"] / _decode(b_tput[key])["decode_tok_s"]
            if key in o_tput:
                row["vs_offload"] = d["decode_tok_s"] / _decode(o_tput[key])["decode_tok_s"]
            if key in raw_tput:
                row["coded_over_raw"] = d["decode_tok_s"] / _decode(raw_tput[key])["decode_tok_s"]
            rows.append(row)
    return rows


def run_rows(results: dict) -> list[dict]:
    rows = []
    for name, r in results.items():
        slots = sorted({v["num_slots"] for v in (r.get("layers") or {}).values()})
        gpu = r.get("gpu") or {}
        rows.append(dict(
            run=name, status=r.get("status"), impl=r["spec"]["impl"], K=r["spec"]["k"] or "–",
            K_in_effect=",".join(map(str, slots)) or "–", mem_fraction=r["spec"]["mem"],
            load_s=r.get("load_s"), wall_s=r.get("wall_s"),
            peak_allocated_GB=gpu.get("peak_allocated", 0) / 1e9 or None,
            host_peak_GB=r.get("children_max_rss_kb", 0) / 1e6 or None,
            device_used_GB=gpu.get("device_used", 0) / 1e9 or None,
            memcpy_GBs=r.get("memcpy_gbs"),
        ))
    return rows


def goal_rows(tput_rows: list[dict]) -> list[dict]:
    out = []
    for row in tput_rows:
        if "vs_builtin" in row:
            out.append(dict(run=row["run"], batch=row["batch"], moepage_over_builtin=row["vs_builtin"],
                            goal=VS_BUILTIN.verdict(row["vs_builtin"])))
    return out


def cell(v) -> str:
    """Three significant figures (whole numbers from 100), "–" where there is no figure."""
    if v is None:
        return "–"
    return (f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}") if isinstance(v, float) else str(v)


def table(rows: list[dict]) -> str:
    return common.table(rows, cell, missing="–", empty="(none)") + "\n"


def plot(tput_rows: list[dict], path: Path) -> bool:
    """Decode tokens/s per batch size of the bf16 Qwen runs with breakable prefill: one group of
    bars per K (unpaged, moepage, built-in, bound). False where matplotlib is missing."""
    by = {(r["run"], r["batch"]): r for r in tput_rows}
    batches = sorted({r["batch"] for r in tput_rows})
    ks = sorted({int(r["run"].split("-k")[1].split("-")[0]) for r in tput_rows
                 if r["run"].startswith("qwen-moepage-k") and not r["run"].endswith("nopg")})
    if not batches or not ks:
        return False
    try:
        fig, axes = common.figure(len(ks), (5, 3.6))
    except ImportError:
        return False
    for ax, k in zip(axes, ks):
        series = [("qwen-unpaged", "decode_tok_s", "unpaged"), (f"qwen-moepage-k{k}", "decode_tok_s", "moepage"),
                  (f"qwen-builtin-k{k}", "decode_tok_s", "SGLang built-in"),
                  (f"qwen-moepage-k{k}", "bound_tok_s", "bound")]
        common.bars(ax, [(label, [(by.get((run, b)) or {}).get(key) or 0 for b in batches])
                         for run, key, label in series])
        ax.set_xticks(range(len(batches)), [str(b) for b in batches])
        ax.set(xlabel="requests in the batch", ylabel="decode tokens/s", title=f"K = {k} of 128")
        ax.legend(fontsize=7)
    common.save(fig, path)
    return True


def write_report(out: Path) -> str:
    out = Path(out)
    results = load(out)
    if not results:
        return f"no run results in {out}"
    tput = throughput_rows(results)
    md = [
        "## SGLang engine: moepage vs unpaged vs SGLang's built-in (bench/sglang_engine.py)\n",
        "### Runs\n", table(run_rows(results)),
        "### Correctness (greedy token ids against the unpaged engine)\n", table(correctness_rows(results)),
        "### Diversity of the random-weight outputs (batch phase)\n", table(diversity_rows(results)),
        "### Throughput\n", table(tput),
        "### Goal: moepage decode tokens/s >= the built-in's at equal K\n", table(goal_rows(tput)),
        "### Where a decode step's GPU time goes (profile phase)\n", table(step_profile.rows(results)),
    ]
    if plot(tput, out / "sglang_engine.png"):
        md.append("![decode tokens/s](sglang_engine.png)\n")
    (out / "REPORT.md").write_text("\n".join(md))
    short = []
    corr = {r["run"]: r for r in correctness_rows(results)}
    for row in run_rows(results):
        c = corr[row["run"]]
        decode = {t["batch"]: t for t in tput if t["run"] == row["run"]}
        short.append(dict(
            run=row["run"], status=row["status"], K=row["K_in_effect"] if row["K"] == "auto" else row["K"],
            batch=c["batch"].split(" ")[0], sequential=c["sequential"].split(" ")[0],
            concurrent=c["concurrent"].split(" ")[0],
            **{f"tok/s b{b}": decode[b]["decode_tok_s"] for b in sorted(decode)},
            **{f"/builtin b{b}": decode[b].get("vs_builtin") for b in sorted(decode)},
            **{f"coded/raw b{b}": decode[b]["coded_over_raw"] for b in sorted(decode) if "coded_over_raw" in decode[b]},
        ))
    return f"wrote {out / 'REPORT.md'}\n\n" + table(short)
