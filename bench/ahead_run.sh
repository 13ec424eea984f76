#!/usr/bin/env bash
# One call on a lent GPU: sampling ahead (KernelConfig.sample_ahead) against
# finalize's sampling. Its GPU tests (the kernel against torch, the backend
# with and without it in CUDA graphs, a real shape's tokens), then one
# stream's request interval by interval with and without it, then
# bench.speed's cells with and without it, per shape. Each section's output
# goes to its own file under $OUT (three files).
#
# Knobs (environment): TESTS (1), TEST_SECONDS (240), MODELS (llama1b),
# INTERVALS (1), SPEED_SECONDS (80 a run), STREAMS (1),
# WORKLOADS (text,point,detect), AHEAD (0: the rows of the run against the
# default).
set -u
out="${OUT:-/tmp/bubblefree-ahead}"
mkdir -p "$out"
. bench/gpu_env.sh
tests_first "$out" "${TEST_SECONDS:-240}" tests/test_greedy_sample.py tests/test_sample_ahead.py \
  tests/test_cuda_backend.py tests/test_backend_contract.py
{
  if [ "${INTERVALS:-1}" = 1 ]; then
    for rows in default "${AHEAD:-0}"; do
      flag=""; [ "$rows" != default ] && flag="--sample-ahead $rows"
      echo "== bench.request_intervals --model llama1b $flag"
      timeout -k 10 90 python3 -m bubblefree.bench.request_intervals --model llama1b $flag 2>&1
    done
  fi
} 2>&1 | quiet | tee "$out/intervals.txt"
SPEED_SECONDS="${SPEED_SECONDS:-80}" speed_ab --sample-ahead "${AHEAD:-0}" ${MODELS:-llama1b} 2>&1 \
  | quiet | tee "$out/speed.txt"
exit 0
