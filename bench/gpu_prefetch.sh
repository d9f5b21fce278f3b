#!/usr/bin/env bash
# The H200 lease for issue 15 (prefetch), one device call from the project's root, with the
# image's python (torch 2.11, transformers 5.17): trains the h200 preset of bench/models/train_moe.py
# in the background while the GPU tests run, then runs bench/models/prefetch_bench.py on it.
# Everything it keeps is under $OUT (train.log, gpu_tests.log, bench.log, loss.json/png and
# prefetch_bench.{json,md,png}).
#   bash bench/gpu_prefetch.sh [train minutes, default 2.5] [bench timeout s, default 330]
set -uo pipefail
OUT=${OUT:-/tmp/moepage_out}; mkdir -p "$OUT"
# moepage's entry points (its HF runners among them) without an install: a dist-info made from
# pyproject.toml in /tmp/moepage_ep. Without it the HF experts get the generic runner, which is not
# bit-exact on CUDA.
bash bench/gpu_sglang_lease.sh ep
export PYTHONPATH=$PWD:/tmp/moepage_ep${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import importlib.metadata as m; print('moepage.runners entry points:', [e.name for e in m.entry_points(group='moepage.runners')])"
CKPT=/tmp/h200_moe
( python3 -m bench.models.train_moe --preset h200 --out "$CKPT" --minutes "${1:-2.5}" > "$OUT/train.log" 2>&1
  echo "train exit $?" >> "$OUT/train.log" ) &
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?" >> "$OUT/gpu_tests.log"; tail -n 4 "$OUT/gpu_tests.log"
wait; tail -n 3 "$OUT/train.log"
cp "$CKPT"/loss.json "$CKPT"/loss.png "$OUT/" 2>/dev/null
timeout "${2:-330}" python3 -m bench.models.prefetch_bench --ckpt "$CKPT" --train-minutes 1.5 --out "$OUT" --steps 48 --reps 2 \
  > "$OUT/bench.log" 2>&1
echo "bench exit $?" >> "$OUT/bench.log"; tail -n 70 "$OUT/bench.log"
