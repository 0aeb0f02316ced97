#!/usr/bin/env bash
# Every GPU check in one command (for a machine with CUDA): the GPU tests, then the GPU
# benchmark. Output goes to ${OUT:-gpu_results}/ (pytest log and benchmark JSON).
#     bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_results}"
mkdir -p "$out"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1
python -m pytest -q tests/gpu -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
python benchmarks/gpu.py 2>&1 | tee "$out/gpu_benchmark.json"
bench=${PIPESTATUS[0]}
echo "gpu tests exit $tests, benchmark exit $bench"
exit $(( tests || bench ))
