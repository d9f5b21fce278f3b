#!/usr/bin/env bash
# The H200 lease for SGLang end to end (issues 10 and 11): the engine check and
# bench/serving/sglang_engine.py, one step per device call, from the project's root.
#
# moepage reaches SGLang through its entry point (group sglang.srt.plugins), which SGLang reads
# with importlib.metadata in every process it starts. Nothing is installed: every step puts the
# project on PYTHONPATH beside a moepage-<version>.dist-info made from pyproject.toml in
# /tmp/moepage_ep (no pip, no setuptools, no network; the scheduler processes inherit it).
#
# On the CPU machine, once (see ../shared/gpu-sglang/README.md):
#   echo /.gpu-sglang/ >> .git/info/exclude && ../shared/gpu-sglang/fetch.sh
#   cp ../shared/gpu-sglang/engine_check.py .gpu-sglang/
#
# Device calls, on one machine kept up between them (it keeps /tmp only while it stays up):
#  0. send the first call alone and read its reply: where no machine starts, every call already queued behind it is
#     refused at a cost of device time (15 s each), and no machine is tried again for about 10 minutes.
#  1. each part alone: `bash bench/gpu_sglang_launch.sh`, carry [".gpu-sglang/<part>", .gpu-sglang/SHA256SUMS,
#     .gpu-sglang/assemble.sh, .gpu-sglang/engine_check.py, lease.env] (~21 calls, ~5 s each; each reply prints the
#     settings it keeps: check them before the last part). Once the last part is there it
#     runs steps 2.. in the background as bench/gpu_sglang_session.sh (settings from an untracked ./lease.env:
#     never commit it). Issue every part call and the first long wait (sleep; cat progress) as one block of
#     calls: a gap of 30 s between calls gives the machine back. Read each reply's parts= count and "warm": a
#     refused or fresh machine mid-sequence lacks the earlier parts (start the sequence again). An earlier lease's
#     Marlin builds (`bash bench/gpu_sglang_session.sh collect-jit`: jit.tgz.0-2, kept out of git), copied into
#     .gpu-sglang/, go in a first call of their own (carry them with SHA256SUMS, assemble.sh and lease.env, no part):
#     the session then skips the ~6 min of builds. To change a
#     running session's later steps, stop its processes by PID from `ps -o pid,ppid,args`: its background steps are
#     subshells with the same command line as the session, so a pgrep/pkill on that line takes them too.
#  2. bash /tmp/parts/assemble.sh && bash bench/gpu_sglang_lease.sh setup            (~1 min)
#     (prints the moepage entry point SGLang will see, and where it comes from)
#  3. bash bench/gpu_sglang_lease.sh engine-check                                     (~3-4 min)
#     engine_check.py (E = 32, top-4) at SEQ=1 K=4, unpaged / moepage / builtin; prints how
#     many of the 16 outputs equal unpaged (issue 10's acceptance: moepage 16 of 16).
#  4. bash bench/gpu_sglang_lease.sh bench core,auto 500                             (<= 9 min)
#  5. bash bench/gpu_sglang_lease.sh bench nopg,fp8,ctfp8,mixtral,extra,compress 500 (<= 9 min)
#     Resumable: a run already ok is skipped, so step 5 also finishes what step 4 left.
#     The Marlin groups (gptq, awq, ctw4a16, mxfp4, nograph) go after the Marlin builds (the session's prebuild or
#     step 7), which SGLang's JIT cache keeps; an engine that must build them first takes about 6 min more to start.
#  6. bash bench/gpu_sglang_lease.sh report                                           (~5 s)
#  7. bash bench/gpu_sglang_lease.sh formats [K_EXPR]                                 (<= 9 min)
#     tests/gpu/test_sglang_formats_gpu.py: every SGLang format served exactly or refused, in one pytest
#     process ($OUT/formats.tgz: its log and summary.txt), or FORMAT_JOBS processes at once, one per test (a log
#     per test). MEASURE=1 (set, to anything but empty) runs the measurements instead, one process per test
#     ($OUT/formats_measured.tgz).
#  8. bash bench/gpu_sglang_lease.sh http ckpt; then http unpaged, http moepage, http builtin
#     (one server each, ~2-3 min), then http report: bench/serving/http_server.py, the real
#     launch_server through the plugin and its OpenAI API ($OUT/http.tgz). The HTTP server imports
#     packages the parts lack; here, once, unpack their cp312 wheels into .gpu-sglang/extra_site:
#       pip download --dest /tmp/w --only-binary=:all: --python-version 3.12 --no-deps \
#         --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#         jsonschema jsonschema-specifications referencing rpds-py attrs soundfile cffi pycparser \
#         msgspec orjson openai-harmony
#       for w in /tmp/w/*.whl; do python -m zipfile -e "$w" .gpu-sglang/extra_site; done
#     and carry .gpu-sglang/extra_site in the `http ckpt` call (it is copied into the site tree).
# The machine goes back after 30 s with no call in flight (a new one needs every part again): run long work in the
# background (setsid) and keep a call waiting on it while you read results; bench/gpu_sglang_session.sh does that
# for the correctness steps and the engine runs of one lease.
# Every step copies what it produced to $OUT (engine_check/, sglang_engine/ with REPORT.md, the
# plot, each run's JSON and log). The report can also be rebuilt here, from those JSONs:
#   python -m bench.serving.sglang_engine --out <fetched sglang_engine dir> --report
set -euo pipefail
REPO=$(pwd)
SGL_ENV=${SGL_ENV:-/tmp/sgl/env.sh}  # written by assemble.sh
EP=${MOEPAGE_EP_DIR:-/tmp/moepage_ep}
BENCH_OUT=/tmp/moepage_sglang_bench
OUT=${OUT:-/tmp/moepage_out}

write_ep() {  # the moepage dist-info (its entry points) in $EP, and PYTHONPATH to it and the project
  rm -rf "$EP" && mkdir -p "$EP"
  python3 - "$REPO/pyproject.toml" "$EP" <<'PY'
import pathlib, re, sys, tomllib
root = pathlib.Path(sys.argv[1]).parent
project = tomllib.loads(pathlib.Path(sys.argv[1]).read_text())["project"]
version = project.get("version") or re.search(r'__version__ = "([^"]+)"', (root / "moepage/__init__.py").read_text()).group(1)
info = pathlib.Path(sys.argv[2]) / f"{project['name']}-{version}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {version}\n")
lines = []
for group, entries in project.get("entry-points", {}).items():
    lines += [f"[{group}]"] + [f"{k} = {v}" for k, v in entries.items()] + [""]
(info / "entry_points.txt").write_text("\n".join(lines))
PY
  export PYTHONPATH="$REPO:$EP${PYTHONPATH:+:$PYTHONPATH}"
  mkdir -p "$OUT"
}

prepare() {
  [ -f "$SGL_ENV" ] || { echo "no $SGL_ENV: send the parts and run /tmp/parts/assemble.sh first" >&2; exit 2; }
  . "$SGL_ENV"
  write_ep
}

entry_point() {
  python3 - <<'PY'
import importlib.metadata as md
eps = [e for e in md.entry_points(group="sglang.srt.plugins") if e.name == "moepage"]
assert eps, "the moepage entry point is not visible"
print("entry point:", ", ".join(f"{e.value} (from {getattr(e.dist, '_path', '?')})" for e in eps))
PY
}

case "${1:-}" in
  ep)  # source-able: `. bench/gpu_sglang_lease.sh ep` gives the image's python the entry points
    write_ep
    ;;
  entry-point)
    prepare
    entry_point
    ;;
  setup)
    prepare
    entry_point
    python3 - <<'PY'
import moepage, sglang, torch
from cuda.bindings import driver  # noqa: F401  (moepage's cuda backend)
import moepage.backends.cuda  # noqa: F401
print("moepage", moepage.__file__, "| sglang", sglang.__version__, "| torch", torch.__version__,
      "| cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY
    ;;
  engine-check)
    prepare
    CHECK=/tmp/parts/engine_check.py
    [ -f "$CHECK" ] || CHECK=.gpu-sglang/engine_check.py
    python3 "$CHECK" ckpt
    for mode in unpaged moepage builtin; do
      SEQ=1 K=4 python3 "$CHECK" "$mode" > "$OUT/engine_check_$mode.log" 2>&1 \
        || { echo "== engine_check $mode failed; its log:"; cat "$OUT/engine_check_$mode.log"; }
      tail -n 2 "$OUT/engine_check_$mode.log"
    done
    cp /tmp/out_*.json "$OUT/" 2>/dev/null || true
    python3 - <<'PY'
import json, os
ref = json.load(open("/tmp/out_unpaged.json"))
for mode in ("moepage", "builtin"):
    if not os.path.exists(f"/tmp/out_{mode}.json"):
        print(f"{mode}: no output"); continue
    got = json.load(open(f"/tmp/out_{mode}.json"))
    equal = sum(a == b for a, b in zip(ref, got))
    first = next(((i, next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
                  for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    print(f"engine_check SEQ=1 K=4 {mode}: {equal}/{len(ref)} outputs equal to unpaged; first difference (request, token): {first}")
PY
    ;;
  bench)
    prepare
    python3 -m bench.serving.sglang_engine --out "$BENCH_OUT" --only "${2:?groups or runs, e.g. core,auto}" --budget "${3:-500}" \
      || echo "bench.serving.sglang_engine exited with $?"
    tar czf "$OUT/sglang_engine.tgz" -C "$(dirname "$BENCH_OUT")" "$(basename "$BENCH_OUT")"  # $OUT returns 8 files at most
    ;;
  report)
    prepare
    python3 -m bench.serving.sglang_engine --out "$BENCH_OUT" --report
    cp "$BENCH_OUT"/REPORT.md "$OUT/" 2>/dev/null || true
    tar czf "$OUT/sglang_engine.tgz" -C "$(dirname "$BENCH_OUT")" "$(basename "$BENCH_OUT")"
    ;;
  formats)
    prepare
    # The tests run in one pytest process (verbose, so a cut run still says how far it got), or, with FORMAT_JOBS
    # set, one process per test, FORMAT_JOBS at once, each under its own limit (FORMAT_TEST_LIMIT, default 150 s)
    # with its own log. The measurements (MEASURE=1: whether a refused format would be exact with its refusal
    # lifted) always run so. SGLang builds its Marlin MoE kernel at first use (about 10 min per set of variants): in
    # processes of their own, the fp16 and bf16 sets build side by side, and a slow case takes neither another's
    # time nor its report (SGLang's JIT cache locks a variant: a second process needing it waits and reuses it).
    # ${2:-}: a -k expression selecting the tests (default: all of the file).
    FILE=tests/gpu/test_sglang_formats_gpu.py
    LOGS=${FORMAT_LOGS:-/tmp/formats${MEASURE:+_measured}_logs}  # more files than $OUT returns: one tarball
    rm -rf "$LOGS" && mkdir -p "$LOGS"
    if [ -z "${MEASURE:-}" ] && [ -z "${FORMAT_JOBS:-}" ]; then
      rc=0
      timeout "${FORMAT_LIMIT:-540}" python3 -m pytest -v -p no:cacheprovider "$FILE" ${2:+-k "$2"} -rfEs --tb=short \
        > "$LOGS/formats.log" 2>&1 || rc=$?
      { grep -E "PASSED|FAILED|SKIPPED|ERROR|^E |passed|failed" "$LOGS/formats.log" || true; } | cut -c1-300 \
        | tee "$LOGS/summary.txt"
      echo "formats: pytest rc=$rc"
    else
      python3 -m pytest -q --co -p no:cacheprovider "$FILE" ${2:+-k "$2"} ${MEASURE:+--measurements} | grep "::" \
        > "$LOGS/ids.txt" || true
      test_one() {  # one test, its own process, limit and log; prints its summary line
        local id=$1 name start rc=0
        name=$(echo "$id" | sed 's/.*:://; s/[^A-Za-z0-9_.-]/_/g')
        start=$(date +%s)
        timeout "${FORMAT_TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider "$id" ${MEASURE:+--measurements} \
          -rfEsP --tb=short > "$LOGS/$name.log" 2>&1 < /dev/null || rc=$?  # not the loop's list of ids
        echo "$id rc=$rc $(( $(date +%s) - start ))s $(grep -E '^E |passed|failed|skipped' "$LOGS/$name.log" | head -n 3 | cut -c1-300 | tr '\n' ' ')"
      }
      while read -r id; do
        while [ "$(jobs -rp | wc -l)" -ge "${FORMAT_JOBS:-1}" ]; do wait -n; done
        test_one "$id" >> "$LOGS/summary.txt" &
      done < "$LOGS/ids.txt"
      wait
      cat "$LOGS/summary.txt"
      ok=$(grep ' rc=0 ' "$LOGS/summary.txt" | grep -c ' passed' || true)
      skipped=$(grep ' rc=0 ' "$LOGS/summary.txt" | grep -v ' passed' | grep -c ' skipped' || true)
      echo "formats: $ok passed, $skipped skipped, $(( $(wc -l < "$LOGS/ids.txt") - ok - skipped )) failed or cut"
    fi
    tar czf "$OUT/formats${MEASURE:+_measured}.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
    ;;
  http)
    prepare
    HTTP_CKPT=/tmp/http_ckpt HTTP_OUT=/tmp/http_out
    [ -d .gpu-sglang/extra_site ] && cp -r --update=none .gpu-sglang/extra_site/* /tmp/sgl/site/
    case "${2:?ckpt, unpaged, moepage, builtin or report}" in
      ckpt) python3 -m bench.serving.http_server ckpt --dir "$HTTP_CKPT" ;;
      report) python3 -m bench.serving.http_server report --out "$HTTP_OUT" ;;
      *) python3 -m bench.serving.http_server serve "$2" --dir "$HTTP_CKPT" --out "$HTTP_OUT" ${3:+--k "$3"} \
           || { echo "http $2 exited with $?"; tail -n 60 "$HTTP_OUT/$2.server.log"; } ;;
    esac
    [ -d "$HTTP_OUT" ] && tar czf "$OUT/http.tgz" -C /tmp "$(basename "$HTTP_OUT")"  # JSONs, server logs, REPORT.md
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
