#!/usr/bin/env bash
# One device call of a lease's part sequence (bench/gpu_sglang_lease.sh, step 1), from the project's root: keeps the
# parts the call carried in /tmp/parts and prints how many are there; once all of them are, starts the lease's work
# in the background, once: assemble, SGLang's environment, then bench/gpu_sglang_session.sh with the settings of
# ./lease.env (never committed; e.g. FORMAT_K=..., BENCH=...), logged to /tmp/session.log. Each call keeps lease.env
# in /tmp/parts too: the tree a call leaves can change under the background session (a lease lost its settings so).
#   every call:  bash bench/gpu_sglang_launch.sh      (carry: SHA256SUMS, assemble.sh, engine_check.py, one part,
#                                                      lease.env; a call of its own may carry .gpu-sglang/jit.tgz.*,
#                                                      an earlier lease's SGLang JIT builds, unpacked before the work;
#                                                      or one vLLM part, .gpu-vllm/part.*, kept in /tmp/vparts for
#                                                      VLLM_BENCH: send those before SGLang's last part)
#   then:        sleep 50; cat /tmp/session/progress.txt
set -u
PARTS=${PARTS_WANTED:-21}
mkdir -p /tmp/parts && cp .gpu-sglang/part.* .gpu-sglang/SHA256SUMS .gpu-sglang/*.sh .gpu-sglang/*.py lease.env \
  .gpu-sglang/jit.tgz.* /tmp/parts/ 2>/dev/null
mkdir -p /tmp/vparts && cp .gpu-vllm/part.* .gpu-vllm/SHA256SUMS .gpu-vllm/assemble.sh /tmp/vparts/ 2>/dev/null  # vLLM's
n=$(ls /tmp/parts/part.* 2>/dev/null | wc -l)
echo "parts=$n of $PARTS, vLLM parts=$(ls /tmp/vparts/part.* 2>/dev/null | wc -l); settings: $(tr '\n' ' ' < /tmp/parts/lease.env 2>/dev/null || echo 'none (no lease.env)')"
[ "$n" -ge "$PARTS" ] && mkdir /tmp/started 2>/dev/null || exit 0
(setsid nohup bash -c '
  bash /tmp/parts/assemble.sh > /tmp/assemble.log 2>&1 || { echo "assemble failed: /tmp/assemble.log" > /tmp/assemble_failed; exit 1; }
  . /tmp/sgl/env.sh || exit 1
  ls /tmp/parts/jit.tgz.* >/dev/null 2>&1 && mkdir -p ~/.cache/sglang && cat /tmp/parts/jit.tgz.* | tar xzf - -C ~/.cache/sglang
  set -a; [ -f /tmp/parts/lease.env ] && . /tmp/parts/lease.env; set +a
  bash bench/gpu_sglang_session.sh' > /tmp/session.log 2>&1 < /dev/null &)
echo started
