#!/usr/bin/env bash
# The GPU check (issue 13) on one CUDA GPU, in under 8 minutes:
#   1. parity: tests/test_gpu.py (float32 greedy equals `generate` on the GPU with the Triton decode
#      attention and with the torch path; the kernel against float64 in float32, bfloat16, float16);
#   2. figures: bench/gpu_check.py (bfloat16 agreement with `generate`, an engine throughput sweep,
#      the decode attention alone whole and split, its memory at long contexts), as JSON.
# Usage: bash bench/gpu_check.sh [OUT_DIR]     (default: $OUT, else ./gpu_check_out)
# Needs torch with CUDA and Triton, transformers >= 5.23, pytest, and SmolLM2's tokenizer in
# $RILL_GPU_TOKENIZER (default .gpu/smollm2; write it on the CPU machine with
# `.venv/bin/python -m bench.gpu_check --save-tokenizer .gpu/smollm2`). On a machine without network,
# wheels in .whl/ (transformers, say) are installed into a folder of their own first.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu_check_out}}
mkdir -p "$out"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/rill-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/rill-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if ! $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: $PY's torch sees no CUDA GPU here; nothing to check (run this on a GPU machine)"
    exit 2
fi
tok=${RILL_GPU_TOKENIZER:-.gpu/smollm2}
if [ ! -f "$tok/tokenizer.json" ]; then
    echo "gpu_check: no SmolLM2 tokenizer in $tok; write it where the embedded model is installed:"
    echo "  .venv/bin/python -m bench.gpu_check --save-tokenizer $tok"
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
$PY -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__)' | tee -a "$out/gpu.txt"
start=$SECONDS
timeout 180 $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/parity.log"
parity=${PIPESTATUS[0]}
echo "parity: exit $parity after $((SECONDS - start)) s" | tee -a "$out/parity.log"
timeout 240 $PY -m bench.gpu_check --tokenizer "$tok" --out "$out/gpu_check.json" \
    > "$out/figures.log" 2>&1
figures=$?
grep -v "^Loading weights" "$out/figures.log" | grep -E "^(bf16|sweep|attention|memory|\{'gpu)|Error|error" | head -80
echo "figures: exit $figures after $((SECONDS - start)) s"
exit $(( parity || figures ))
