#!/usr/bin/env bash
# Run on the CPU machine, from the project's root: downloads packages.txt (Python 3.12, x86-64 manylinux wheels, no
# dependencies) into one site tree for the GPU machine and lays it out under .gpu-vllm/ (add it to
# .git/info/exclude): parts of at most 54 MB, each small enough to travel alone, SHA256SUMS and assemble.sh. vLLM's
# FlashAttention-2 library (Ampere's; the bench serves with TRITON_ATTN on Hopper) is left out.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUTD=${1:-.gpu-vllm}
W=$(mktemp -d); S=$(mktemp -d)
plat="--platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
grep -vE '^\s*(#|$)' "$HERE/packages.txt" | while read -r req; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $plat -d "$W" "$req" >"$W/.log" 2>&1 || { grep -v "is ignored" "$W/.log"; echo "FAILED: $req" >&2; exit 1; }
done
for whl in "$W"/*.whl; do
  case "$(basename "$whl")" in
    vllm-*) unzip -q -o "$whl" -d "$S" -x 'vllm/vllm_flash_attn/_vllm_fa2_C*';;
    *) unzip -q -o "$whl" -d "$S";;
  esac
done
mkdir -p "$OUTD"; rm -f "$OUTD"/part.* "$OUTD"/SHA256SUMS
tar czf "$OUTD/vllm_site.tgz" -C "$S" .
(cd "$OUTD" && split -b 54M -d -a 2 vllm_site.tgz part.vllm_site.tgz. && rm vllm_site.tgz && sha256sum part.* > SHA256SUMS)
cp "$HERE/assemble.sh" "$OUTD/"
rm -rf "$W" "$S"
ls -la "$OUTD"; echo "$(ls "$OUTD"/part.* | wc -l) parts; send each alone after gpu-sglang's (bench/gpu_vllm/README.md)"
