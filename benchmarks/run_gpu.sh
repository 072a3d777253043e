#!/usr/bin/env bash
# On one GPU machine: the tests that touch the GPU (in order, or its files reversed; the stream-sanitizer pass on
# its own), the platform report with bandwidths, and the benchmarks. Results land in ${OUT:-benchmarks/results}.
#   bash benchmarks/run_gpu.sh [tests|tests-reversed|sanitizer|bench|all]
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
what=${1:-all}
status=0
run() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n 4 "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
}
if [ "$what" = tests ] || [ "$what" = all ]; then
  # The tests that touch the GPU (CI runs the rest on a CPU).
  run gpu_tests python -m pytest -q -rfEs -p no:cacheprovider --gpu-suite test/
  run platform python -m torch_fsdp_offload platform --bandwidth
fi
if [ "$what" = tests-reversed ]; then
  # The same suite with its files in reverse order: no test may depend on what ran before it.
  run gpu_tests_reversed python -m pytest -q -rfEs -p no:cacheprovider --gpu-suite $(ls test/test_*.py | sort -r)
fi
if [ "$what" = sanitizer ]; then
  TORCH_CUDA_SANITIZER=1 run gpu_tests_sanitizer python -m pytest -q -rs -p no:cacheprovider test/test_transfer.py \
      test/test_fsdp2_offload_gpu.py test/test_activations.py -k "GPU or Gpu or gpu or Cuda or cuda"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  run bench_transfer python benchmarks/transfer.py --out "$OUT/transfer.json"
  run bench_fsdp_offload python benchmarks/fsdp_offload.py --out "$OUT/fsdp_offload.json" ${FSDP_ARGS:-}
fi
exit $status
