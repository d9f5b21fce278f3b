#!/usr/bin/env bash
# The core GPU work of a lease, without SGLang: the GPU tests, the examples, and the kernel and
# layer benchmarks, on the image's own torch. Each step logs to /tmp/core_out/<step>.log and adds
# a line to summary.txt; DONE marks the end. Meant to run in the background while SGLang's parts
# are being sent (a process in its own session outlives the call that started it):
#
#   setsid nohup bash bench/gpu_core.sh run > /tmp/core_bg.log 2>&1 < /dev/null &
#   (STEPS="pytest_gpu cuda_bench" runs only those steps, STEPS=split_decode the CPU-share bench, which runs only when
#    named; MD_ARGS adds model_decode's arguments, e.g.
#    "--skip-empty-waves --kfrac 0.25,0.75"; GPU_TESTS names the GPU tests' files, default all of tests/)
#   bash bench/gpu_core.sh status              # the summary so far
#   bash bench/gpu_core.sh collect             # $OUT/core.tgz (every log and JSON) + the summary
set -u
CORE=/tmp/core_out

step() {  # step NAME CMD...: run CMD with a time limit, log it, record its status and time
  local name=$1 start rc
  shift
  case " ${STEPS:-$name} " in *" $name "*) ;; *) return ;; esac  # STEPS="a b": only those
  start=$(date +%s)
  timeout "${STEP_LIMIT:-900}" "$@" > "$CORE/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start ))s" >> "$CORE/summary.txt"
}

case "${1:-run}" in
  run)
    rm -rf "$CORE" && mkdir -p "$CORE"
    # Run from a copy: every device call syncs the working tree, under a job still running.
    rm -rf /tmp/core_repo && cp -r "$PWD" /tmp/core_repo && cd /tmp/core_repo || exit 1
    bash bench/gpu_sglang_lease.sh ep > "$CORE/ep.log" 2>&1  # entry points for the runner registry
    export PYTHONPATH="$PWD:/tmp/moepage_ep${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # env.sh's torch stays ahead of the image's
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$CORE/gpu.txt" 2>&1
    # Timings first, while the machine has nothing else to do; then the tests and examples.
    [ -d .before ] && step hit_before_after python3 -m bench.kernels.hit_before_after --before .before \
      --json "$CORE/hit_before_after.json"
    step cuda_bench python3 -m bench.kernels.cuda_bench --skip-rss --json "$CORE/cuda.json"
    step decode_profile python3 -m bench.kernels.decode_profile --tokens 1 4 8 32
    # Whole-model captured decode; the Granite rows replay its real trace (carry .traces, a copy of the shared folder's
    # traces: .gitignore lists it, and a path travels as carry only if ignored)
    [ -d .traces ] && export MOEPAGE_TRACES=$PWD/.traces
    step model_decode python3 -m bench.models.model_decode --out "$CORE/md" --model "${MD_MODEL:-granite}" \
      --policies lfu --steps 48 --warmup 24 ${MD_ARGS:-}
    # A CPU share against page-in only (docs/cpu-split.md): long (48 layers, batch 32, a disk tier), so only when
    # STEPS names it; SPLIT_ARGS adds its arguments (e.g. "--models qwen3-8 --batch 1,8")
    case " ${STEPS:-} " in
      *" split_decode "*) STEP_LIMIT=${SPLIT_LIMIT:-2700} step split_decode python3 -m bench.models.split_decode \
        --out "$CORE/split" ${SPLIT_ARGS:-} ;;
    esac
    step compress_bench python3 -m bench.kernels.compress_bench --json "$CORE/compress.json"
    step prefill_bench python3 -m bench.models.prefill_bench
    step quickstart python3 examples/quickstart.py
    step hf_generate python3 examples/hf_generate.py
    # SGLang's tests import it (the [test] extra installs it); the image's python has none: leave them to the lease
    NO_SGLANG=$(python3 -c "import sglang" 2>/dev/null || echo "--ignore=tests/integrations/sglang --ignore=tests/gpu/test_sglang_formats_gpu.py")
    step pytest_gpu python3 -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors ${GPU_TESTS:-tests} -rfEs $NO_SGLANG
    touch "$CORE/DONE"
    ;;
  status)
    cat "$CORE/summary.txt" 2>/dev/null
    [ -f "$CORE/DONE" ] && echo "core: DONE" || echo "core: running"
    ;;
  collect)
    cat "$CORE/summary.txt" 2>/dev/null
    for f in "$CORE"/*.log; do echo "== $(basename "$f")"; tail -n 25 "$f"; done
    tar czf "${OUT:?}/core.tgz" -C /tmp core_out
    ;;
  *)
    sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 2 ;;
esac
