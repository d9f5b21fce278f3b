#!/usr/bin/env bash
# Run on the GPU machine once every vLLM part is in $PARTS (default /tmp/vparts) and gpu-sglang's assemble.sh has
# made /tmp/sgl: checks SHA256SUMS, unpacks the site into /tmp/vllm/site (nothing of the image changes) and writes
# /tmp/vllm/env.sh, which sources /tmp/sgl/env.sh and puts the vLLM site first.
set -euo pipefail
PARTS=${PARTS:-/tmp/vparts}; T=/tmp/vllm
[ -f /tmp/sgl/env.sh ] || { echo "no /tmp/sgl/env.sh: assemble gpu-sglang's parts first (torch, triton, NCCL)" >&2; exit 2; }
(cd "$PARTS" && sha256sum -c --quiet SHA256SUMS)
mkdir -p "$T/site"
cat "$PARTS"/part.vllm_site.tgz.* | tar xzf - -C "$T/site"
cat > "$T/env.sh" <<EOT
. /tmp/sgl/env.sh
export PYTHONPATH=$T/site\${PYTHONPATH:+:\$PYTHONPATH}
EOT
. "$T/env.sh"
python3 -c "import torch, triton, vllm; print('torch', torch.__version__, 'triton', triton.__version__, 'vllm', vllm.__version__, 'cuda', torch.cuda.is_available())"
