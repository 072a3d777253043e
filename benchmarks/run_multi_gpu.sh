#!/usr/bin/env bash
# On a multi-GPU machine: NCCL tests, two torchrun agents acting as two nodes, the 8B benchmark.
# Logs and JSON land in ${OUT:-benchmarks/results}; each stage ends with a short summary.
#   bash benchmarks/run_multi_gpu.sh [tests] [multinode] [bench]      (no argument: all three)
# Expected on 2 x H200: tests ~1.5 min, multinode ~1 min, bench ~6.5 min (--time-budget BENCH_BUDGET
# seconds, default 360, stops starting new work). Each stage is killed after its limit below, so
# `tests multinode` fits one 9-minute call (7 min at worst) and `bench` another (7.5 min at worst).
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
# NVLink multicast off in every process (some multi-GPU VMs refuse it; NCCL then hangs at init).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site:.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# The 2 x H200 VM hot-plugs its memory: MemAvailable reads ~31 GiB at start, 255 GiB once used.
export TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES=${TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES:-240GiB}

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests multinode bench)
for stage in "${stages[@]}"; do
  case $stage in tests|multinode|bench) ;; *) echo "unknown stage '$stage': use tests, multinode, bench"; exit 2;; esac
done

ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
echo "torch $(python -c 'import torch; print(torch.__version__)'), $ngpu GPUs, $(nproc) cores, host $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
if [ "$ngpu" -lt 2 ]; then echo "needs at least 2 GPUs"; exit 1; fi

status=0
run() {  # name, limit in seconds, command...: own process group, killed whole at the limit
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  setsid "$@" >"$OUT/$name.log" 2>&1 &
  local pid=$!
  # The watchdog has its own process group too (so its sleep dies with it) and no hold on stdout.
  setsid bash -c 'sleep "$1"; echo "[run_multi_gpu.sh] killed after $1s" >>"$3"
    kill -TERM -- "-$2"; sleep 10; kill -KILL -- "-$2"' watchdog "$limit" "$pid" "$OUT/$name.log" \
    </dev/null >/dev/null 2>&1 &
  local watchdog=$!
  wait "$pid"
  local rc=$?
  kill -- "-$watchdog" 2>/dev/null
  wait "$watchdog" 2>/dev/null
  echo "== $name: rc=$rc, $(( $(date +%s) - t0 ))s (log: $OUT/$name.log)"
  [ $rc -eq 0 ] || status=1
}

for stage in "${stages[@]}"; do
  case $stage in
    tests)
      run multi_gpu_tests 240 python -m pytest -q -rs test/test_multi_gpu.py test/test_fsdp1.py \
        -k "MultiGPUOffloadTest or TestFSDP1MultiGPU"
      grep -E "passed|failed|error|skipped" "$OUT/multi_gpu_tests.log" | tail -n 5 ;;
    multinode)
      run multi_gpu_two_agents 180 python -m pytest -q -rs test/test_multi_gpu.py -k TwoAgentHSDPTest
      grep -E "passed|failed|error|skipped" "$OUT/multi_gpu_two_agents.log" | tail -n 5 ;;
    bench)
      # torchrun would set OMP_NUM_THREADS=1: the host optimizer gets the cores of its GPU's share.
      export OMP_NUM_THREADS=$(( $(nproc) / ngpu ))
      run multi_gpu_bench 450 \
        torchrun --standalone --nproc-per-node "$ngpu" benchmarks/multi_gpu.py \
        --out "$OUT/multi_gpu.json" --time-budget "${BENCH_BUDGET:-360}" ${BENCH_ARGS:-}
      sed -n '/, world size [0-9]*, /,$p' "$OUT/multi_gpu_bench.log" | head -n 30
      [ -f "$OUT/multi_gpu.json" ] && echo "JSON: $OUT/multi_gpu.json" ;;
  esac
done
exit $status
