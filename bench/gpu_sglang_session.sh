#!/usr/bin/env bash
# One SGLang lease's work after the parts are assembled (bench/gpu_sglang_lease.sh, steps 1-2), in the
# background, so that device calls only start it and wait: the machine goes back after 30 s without a call in
# flight, and a fresh one needs the parts again. Logs in /tmp/session/ (progress.txt: one line per step).
#
#   (setsid nohup bash bench/gpu_sglang_session.sh > /tmp/session.log 2>&1 < /dev/null &)
#   for i in $(seq 100); do grep -q DONE /tmp/session/progress.txt && break; sleep 5; done; cat /tmp/session/progress.txt
#   bash bench/gpu_sglang_session.sh collect     # $OUT/session.tgz (logs, format logs, engine results)
#   bash bench/gpu_sglang_session.sh collect-jit # $OUT/jit.tgz.N: SGLang's Marlin builds (34 MB), for the next lease
#
# SGLang builds its Marlin MoE kernel at first use, about 10 min for each of its variants (dtype, bias, and the
# second GEMM's zeroed rows): the session starts all six at once (marlin_prebuild), unless the lease carried a
# JIT cache from an earlier one (.gpu-sglang/jit.tgz.N, unpacked by the launcher; the cache keys on the image and
# the parts, so a lease on the same ones reuses it).
#
# Correctness steps run side by side (engine check, format tests, measurements: one process per test, FORMAT_JOBS
# and MEASURE_JOBS at once, 8 by default, FORMAT_TEST_LIMIT seconds each); the engine's throughput runs
# run alone after them. BENCH (runs or groups, comma-separated; "-": none) and BENCH_BUDGET (seconds) choose the engine
# runs, and BENCH_MORE / BENCH_MORE_BUDGET a second round after them; MEASURE_K (a -k expression) and
# MEASURE_LIMIT (seconds for all of them), MEASURE_TEST_LIMIT (seconds for each) and MEASURE_JOBS (how many at
# once) the measurements. The measurements are stopped when the correctness steps are done, unless MEASURE_WAIT=1
# (wait for them) or MEASURE_WAIT=beside (they go on beside the engine runs, up to MEASURE_LIMIT). ENGINE_CHECK=0
# leaves the engine check out (the engine runs check their tokens against unpaged too), MARLIN_PREBUILD=0 the Marlin
# builds (for runs without Marlin formats). FORMAT_K (a -k expression)
# picks the format tests (FORMAT_K=no_such_test: none). CORE_STEPS runs bench/gpu_core.sh's steps (e.g.
# "decode_profile model_decode pytest_gpu", with its MD_ARGS and GPU_TESTS) on SGLang's torch, beside the format tests,
# and BENCH_EARLY (runs, BENCH_EARLY_BUDGET seconds) the engine runs that need no Marlin build right after them,
# still beside the format tests; BENCH and BENCH_MORE wait for the format tests (their Marlin builds). VLLM_BENCH (runs
# or groups of bench/serving/vllm_engine.py, VLLM_BENCH_BUDGET seconds) runs last, alone, once the launcher has
# kept vLLM's parts in /tmp/vparts (their site is assembled while SGLang's runs go); VLLM_LAYERS=1 runs vLLM's layer
# cases (tests/integrations/vllm/vllm_gpu_cases.py) before it.
set -u
S=/tmp/session
if [ "${1:-}" = collect-jit ]; then  # the Marlin builds only (the whole cache is ~96 MB; the rest builds in seconds)
  (cd ~/.cache/sglang && tar czf /tmp/jit.tgz jit/*/sgl_kernel_jit_moe_wna16_marlin_* jit/*/sgl_kernel_jit_*_marlin_repack) \
    && split -b 15M -d -a 1 /tmp/jit.tgz "${OUT:?}/jit.tgz." && ls -l "$OUT"  # pieces of 15 MiB come back with $OUT
  exit 0
fi
if [ "${1:-}" = collect ]; then
  for d in /tmp/fmt_out /tmp/meas_out /tmp/ec_out /tmp/core_out /tmp/formats_logs /tmp/formats_measured_logs \
           /tmp/vllm_out; do [ -d $d ] && cp -r $d $S/; done
  tar czf "${OUT:?}/session.tgz" -C /tmp session $(cd /tmp && ls -d moepage_sglang_bench moepage_vllm_bench 2>/dev/null)
  cat $S/progress.txt; exit 0
fi
rm -rf $S /tmp/session_repo && mkdir -p $S /tmp/session_repo
tar --exclude=./.gpu-sglang --exclude=./.gpu-vllm -cf - . | tar -xf - -C /tmp/session_repo && cd /tmp/session_repo || exit 1  # calls re-sync the tree
say() { echo "$(date +%T) $*" >> $S/progress.txt; }
say start
if [ -n "${VLLM_BENCH:-}${VLLM_EARLY:-}" ]; then  # vLLM's site beside SGLang's torch, built while SGLang's runs go
  (bash /tmp/vparts/assemble.sh > $S/vllm_assemble.log 2>&1; say "vllm assemble: rc=$? $(tail -n 1 $S/vllm_assemble.log)"
   # whether vLLM's stable-ABI libraries load on the image's own torch (then vLLM would need only its own site)
   (unset PYTHONPATH LD_LIBRARY_PATH; PYTHONPATH=/tmp/vllm/site timeout 120 python3 -c "
import torch; print('image torch', torch.__version__)
for lib in ('_C_stable_libtorch', '_moe_C_stable_libtorch'):
    try:
        __import__('vllm.' + lib); print(lib, 'loads')
    except Exception as exc:
        print(lib, 'fails:', repr(exc)[:300])
") > $S/vllm_image_torch.log 2>&1
   say "vllm on the image's torch: $(tr '\n' ';' < $S/vllm_image_torch.log | cut -c1-400)"
   if [ -n "${VLLM_EARLY:-}" ]; then  # correctness runs beside SGLang's (their own checkpoints and entry points)
     OUT=/tmp/vllm_out MOEPAGE_EP_DIR=/tmp/ep_v VLLM_CKPT_DIR=/tmp/vllm_ckpt bash bench/gpu_vllm_lease.sh bench \
       "$VLLM_EARLY" "${VLLM_EARLY_BUDGET:-900}" > $S/vllm_early.log 2>&1
     say "vllm early: $(grep -cE '\| ok \|' /tmp/moepage_vllm_bench/REPORT.md 2>/dev/null) runs ok"
   fi) &
  VASM=$!
fi
if [ "${MARLIN_PREBUILD:-1}" = 0 ]; then  # runs that need no Marlin kernel: nothing to build
  (say "marlin prebuild: skipped (MARLIN_PREBUILD=0)") & PRE=$!
else
(python3 - > $S/marlin_prebuild.log 2>&1 <<'PY'
import time, torch
from sglang.kernels.jit.utils import parallel_compile
from sglang.kernels.ops.moe.moe_wna16_marlin import _jit_moe_wna16_marlin_module as marlin
t = time.time()
# (dtype, is_ep, has_bias, expert_ids_are_sorted, zero_inactive_output, has_inactive_prefix_count), as
# fused_marlin_moe asks for them: GPTQ in fp16, AWQ and compressed-tensors in bf16, MXFP4 in bf16 with biases
variants = [(dt, False, bias, True, zero, True) for dt, bias in ((torch.float16, False), (torch.bfloat16, False),
                                                                  (torch.bfloat16, True)) for zero in (False, True)]
parallel_compile([lambda v=v: marlin(*v) for v in variants])
print(f"marlin prebuild: {len(variants)} variants in {time.time() - t:.0f} s")
PY
 say "$(tail -n 1 $S/marlin_prebuild.log)") &
PRE=$!
fi
if [ "${ENGINE_CHECK:-1}" = 0 ]; then
  (say "engine-check: skipped (ENGINE_CHECK=0)") & EC=$!
else
  (OUT=/tmp/ec_out MOEPAGE_EP_DIR=/tmp/ep_ec bash bench/gpu_sglang_lease.sh engine-check > $S/engine_check.log 2>&1
   say "engine-check: $(grep -h 'outputs equal' $S/engine_check.log | tr '\n' ' ')") &
  EC=$!
fi
(OUT=/tmp/meas_out MOEPAGE_EP_DIR=/tmp/ep_meas MEASURE=1 FORMAT_JOBS=${MEASURE_JOBS:-8} \
   FORMAT_TEST_LIMIT=${MEASURE_TEST_LIMIT:-300} \
   timeout "${MEASURE_LIMIT:-900}" bash bench/gpu_sglang_lease.sh formats "${MEASURE_K:-would_it_be_exact and not block16}" \
   > $S/measurements.log 2>&1; say "measurements done") &
MEAS=$!
# One process per test, 8 at once: the Marlin formats' kernel builds (about 10 min) run side by side
(OUT=/tmp/fmt_out MOEPAGE_EP_DIR=/tmp/ep_fmt FORMAT_JOBS=${FORMAT_JOBS:-8} FORMAT_TEST_LIMIT=${FORMAT_TEST_LIMIT:-900} \
   bash bench/gpu_sglang_lease.sh formats ${FORMAT_K:+"$FORMAT_K"} > $S/formats.log 2>&1
 say "$(grep -E '^formats: ' $S/formats.log | tail -n 1)") &
FMT=$!
if [ -n "${CORE_STEPS:-}" ]; then  # the image's python on SGLang's torch (env.sh): graph conditionals
  STEPS="$CORE_STEPS" bash bench/gpu_core.sh run > $S/core.log 2>&1
  say "core: $(tr '\n' ';' < /tmp/core_out/summary.txt)"
fi
if [ -n "${BENCH_EARLY:-}" ]; then
  say "early engine runs start beside the format tests"
  OUT=/tmp/bench_out MOEPAGE_EP_DIR=/tmp/ep_b bash bench/gpu_sglang_lease.sh bench "$BENCH_EARLY" \
    "${BENCH_EARLY_BUDGET:-400}" > $S/bench_early.log 2>&1
  say "bench early: $(grep -cE '\| ok \|' /tmp/moepage_sglang_bench/REPORT.md 2>/dev/null) runs ok"
fi
wait $FMT
wait $EC
case "${MEASURE_WAIT:-}" in
  1) wait $MEAS ;;
  beside) say "engine runs start beside the measurements" ;;  # small layers; their Marlin builds use the CPU
  *) pkill -f "would_it_be_exact"; sleep 2 ;;
esac
wait $PRE  # the engine runs' Marlin starts find the builds in the JIT cache, not building them again beside it
if [ "${BENCH:-}" = - ]; then  # no SGLang engine round (a lease for vLLM's runs alone)
  say "bench: skipped (BENCH=-)"
else
OUT=/tmp/bench_out MOEPAGE_EP_DIR=/tmp/ep_b bash bench/gpu_sglang_lease.sh bench \
  "${BENCH:-qwen-unpaged,qwen-moepage-k32,qwen-builtin-k32,qwen-moepage-k32-coded}" "${BENCH_BUDGET:-500}" > $S/bench.log 2>&1
say "bench: $(grep -cE '\| ok \|' /tmp/moepage_sglang_bench/REPORT.md 2>/dev/null) runs ok"
fi
OUT=/tmp/bench_out MOEPAGE_EP_DIR=/tmp/ep_b bash bench/gpu_sglang_lease.sh report > $S/report.log 2>&1
if [ -n "${VLLM_BENCH:-}" ]; then  # vLLM's runs (bench/gpu_vllm_lease.sh), alone on the GPU after SGLang's first round
  wait $VASM  # (and after the early vLLM runs: one vLLM engine at a time)
  if [ -n "${VLLM_LAYERS:-}" ]; then  # its layer cases first (a minute): where a paged step parts from unpaged
    OUT=/tmp/vllm_out MOEPAGE_EP_DIR=/tmp/ep_v bash bench/gpu_vllm_lease.sh layers > $S/vllm_layers.log 2>&1
    say "vllm layers: $(grep -E 'passed|failed' $S/vllm_layers.log | tail -n 1)"
  fi
  OUT=/tmp/vllm_out MOEPAGE_EP_DIR=/tmp/ep_v bash bench/gpu_vllm_lease.sh bench "$VLLM_BENCH" "${VLLM_BENCH_BUDGET:-400}" \
    > $S/vllm_bench.log 2>&1
  say "vllm bench: $(grep -cE '\| ok \|' /tmp/moepage_vllm_bench/REPORT.md 2>/dev/null) runs ok"
fi
[ -n "${VLLM_EARLY:-}" ] && { wait $VASM; OUT=/tmp/vllm_out MOEPAGE_EP_DIR=/tmp/ep_v bash bench/gpu_vllm_lease.sh report \
  > $S/vllm_report.log 2>&1; }
if [ -n "${BENCH_MORE:-}" ]; then  # a second round, after vLLM's: its runs cannot take the first's budget
  OUT=/tmp/bench_out MOEPAGE_EP_DIR=/tmp/ep_b bash bench/gpu_sglang_lease.sh bench "$BENCH_MORE" \
    "${BENCH_MORE_BUDGET:-400}" > $S/bench_more.log 2>&1
  OUT=/tmp/bench_out MOEPAGE_EP_DIR=/tmp/ep_b bash bench/gpu_sglang_lease.sh report > $S/report.log 2>&1
fi
say "bench: $(grep -cE '\| ok \|' /tmp/moepage_sglang_bench/REPORT.md 2>/dev/null) runs ok in all rounds"
say DONE
