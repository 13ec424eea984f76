#!/usr/bin/env bash
# One call on a lent GPU: the split attention kernel's launch
# (Dispatch.split_block, split_warps, max_splits) in whole captured steps.
# The GPU tests of the split kernel in those launches (against the portable
# path, its states against the combining pass, whole steps' tokens), then
# bench.step_ab for each shape with the variants below (one process a
# shape), each shape's output to $OUT/steps-M.txt. About 290 s.
#
# Knobs (environment): TESTS (1), TEST_SECONDS (120), MODELS (qwen05b
# llama1b), STEP_SECONDS (200 a shape), ROWS (1,8), INCREMENTS (a variant
# of the first shape whose per-kernel increments to print), and a shape's
# variants in place of the list below (QWEN05B, LLAMA1B; as step_ab's
# --variant takes them, space-separated).
set -u
out="${OUT:-/tmp/bubblefree-split}"
mkdir -p "$out"
. bench/gpu_env.sh
tests_first "$out" "${TEST_SECONDS:-120}" -n 4 tests/test_cuda_gpu.py tests/test_o_combines.py \
  tests/test_pdl_step.py -k "paged_decode_kernel_matches or projection_over_states or launched_otherwise" \
  | tail -15

# max_splits=64 is the default written out: a second measurement of it.
S="base split_warps=1 split_warps=4 split_block=16 split_block=16+split_warps=1
  max_splits=4+split_block=64 max_splits=4+split_block=64+split_warps=1
  max_splits=4+split_block=64+split_warps=4 max_splits=2+split_block=128 max_splits=64"
qwen05b="${QWEN05B:-$S}"
llama1b="${LLAMA1B:-$S}"
step_ab_each "$out" "qwen05b llama1b"
exit 0
