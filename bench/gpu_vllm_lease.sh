#!/usr/bin/env bash
# The H200 lease for vLLM end to end: bench/serving/vllm_engine.py, one step per device call, from the project's root,
# after gpu-sglang's and the vLLM parts are assembled (bench/gpu_vllm/README.md).
#   bash bench/gpu_vllm_lease.sh setup                  the moepage plugin vLLM will load, versions, CUDA
#   bash bench/gpu_vllm_lease.sh bench GROUPS [BUDGET]  e.g. `bench check 500`, then `bench deep 500` (resumable)
#   bash bench/gpu_vllm_lease.sh report                 REPORT.md and the run results in $OUT
#   bash bench/gpu_vllm_lease.sh layers                 vLLM's Triton experts, one layer paged vs unpaged, eager and
#                                                       captured (tests/integrations/vllm/vllm_gpu_cases.py; its log)
set -euo pipefail
VLLM_ENV=${VLLM_ENV:-/tmp/vllm/env.sh}  # written by bench/gpu_vllm/assemble.sh
VLLM_BENCH_OUT=/tmp/moepage_vllm_bench  # not BENCH_OUT: gpu_sglang_lease.sh, sourced below, sets that to its own
OUT=${OUT:-/tmp/moepage_out}

vllm_prepare() {
  [ -f "$VLLM_ENV" ] || { echo "no $VLLM_ENV: assemble the gpu-sglang and vLLM parts first" >&2; exit 2; }
  . "$VLLM_ENV"
  . bench/gpu_sglang_lease.sh ep  # the moepage dist-info (entry points) and the project on PYTHONPATH
  # the site has no FlashInfer: vLLM's sampler would import it on CUDA (its torch sampler serves greedy alike)
  export VLLM_PLUGINS=moepage VLLM_USE_FLASHINFER_SAMPLER=0
}

vllm_entry_point() {
  python3 - <<'PY'
import importlib.metadata as md
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "moepage"]
assert eps, "the moepage vLLM entry point is not visible"
print("entry point:", ", ".join(f"{e.value} (from {getattr(e.dist, '_path', '?')})" for e in eps))
PY
}

case "${1:-}" in
  entry-point)
    vllm_prepare
    vllm_entry_point
    ;;
  setup)
    vllm_prepare
    vllm_entry_point
    python3 - <<'PY'
import torch, vllm
import vllm._C_stable_libtorch  # noqa: F401  (vLLM's kernels on this torch)
print("vllm", vllm.__version__, "| torch", torch.__version__, "| cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY
    ;;
  bench)
    vllm_prepare
    python3 -m bench.serving.vllm_engine --out "$VLLM_BENCH_OUT" --only "${2:?groups or runs, e.g. check}" \
      --budget "${3:-500}" ${VLLM_CKPT_DIR:+--ckpt-dir "$VLLM_CKPT_DIR"} || echo "bench.serving.vllm_engine exited with $?"
    tar czf "$OUT/vllm_engine.tgz" -C "$(dirname "$VLLM_BENCH_OUT")" "$(basename "$VLLM_BENCH_OUT")"
    ;;
  report)
    vllm_prepare
    python3 -m bench.serving.vllm_engine --out "$VLLM_BENCH_OUT" --report
    cp "$VLLM_BENCH_OUT"/REPORT.md "$OUT/" 2>/dev/null || true
    tar czf "$OUT/vllm_engine.tgz" -C "$(dirname "$VLLM_BENCH_OUT")" "$(basename "$VLLM_BENCH_OUT")"
    ;;
  layers)
    vllm_prepare
    mkdir -p "$OUT"
    python3 -m pytest -q -p no:cacheprovider -rA tests/integrations/vllm/vllm_gpu_cases.py > "$OUT/vllm_layers.log" 2>&1 \
      || echo "the vLLM layer cases exited with $?"
    { grep -E "^(PASSED|FAILED|ERROR|SKIPPED) |passed|failed" "$OUT/vllm_layers.log" || true; } | cut -c1-200 | tail -n 40
    ;;
  *)
    sed -n '2,8p' "$0"; exit 2  # usage
    ;;
esac
