#!/usr/bin/env bash
# One call on a lent GPU: the head GEMM sampling ahead itself
# (KernelConfig.head_argmax: each program of the head folds its rows' best
# logit into a word a row, the last writes the tokens; greedy_sample's
# kernel after the head is not launched). The GPU tests of the kernel and
# of whole steps, then bench.step_ab for each shape with the variants
# below (one process a shape; the captured step includes its sampling
# ahead), each shape's output to $OUT/steps-M.txt; then, unless SPEED=0,
# bench.speed's one-stream text cell of each shape in requests, with and
# without it (speed_ab), into $OUT/speed.txt. About 150 s of tests, 150 s a
# shape of steps and 150 s a shape of requests: Qwen2-0.5B (the shape whose
# target is open) in one call; the others in a second call, TESTS=0
# MODELS="llama1b phi".
#
# Knobs (environment): TESTS (1), TEST_SECONDS (150), MODELS (qwen05b),
# STEP_SECONDS (150 a shape), ROWS (1,2,4,8), SPEED (1), SPEED_SECONDS (75
# a run), and a shape's variants in place of the lists below (QWEN05B,
# LLAMA1B, PHI; as step_ab's --variant takes them).
set -u
out="${OUT:-/tmp/bubblefree-head-argmax}"
mkdir -p "$out"
. bench/gpu_env.sh
tests_first "$out" "${TEST_SECONDS:-150}" -n 4 tests/test_head_argmax.py tests/test_gemm_compiles.py \
  tests/test_sample_ahead.py tests/test_greedy_sample.py | tail -15

qwen05b="${QWEN05B:-base head_argmax=8 base head_argmax=8}"
llama1b="${LLAMA1B:-base head_argmax=8 base head_argmax=8}"
phi="${PHI:-base head_argmax=8 base head_argmax=8}"
ROWS="${ROWS:-1,2,4,8}" STEP_SECONDS="${STEP_SECONDS:-150}" step_ab_each "$out" qwen05b
if [ "${SPEED:-1}" = 1 ]; then
  WORKLOADS=text speed_ab --variant head_argmax=8 ${MODELS:-qwen05b} 2>&1 | quiet \
    | tee "$out/speed.txt" | grep "^==\|^| "
fi
exit 0
