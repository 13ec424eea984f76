#!/usr/bin/env bash
# One call on a lent GPU: Llama's and Qwen2's layers without norm kernels
# (KernelConfig.norms_in: q, k, v and gate and up norm the residual stream
# themselves, o and down keep K whole and add it; normed_gemv). The GPU
# tests of the kernel and of whole steps, then bench.step_ab for each shape
# with the variants below (one process a shape), each shape's output to
# $OUT/steps-M.txt; then, if GRID names shapes, their whole grid in
# requests (bench/grid_run.sh, into $OUT/grid). About 450 s, and 185 s a
# shape of GRID.
#
# Knobs (environment): TESTS (1), TEST_SECONDS (200), MODELS (qwen05b
# llama1b), STEP_SECONDS (260 a shape), ROWS (1,2,4), INCREMENTS (a variant of
# the first shape whose per-kernel increments to print), GRID (none), and a
# shape's variants in place of the lists below (QWEN05B, LLAMA1B; as
# step_ab's --variant takes them, space-separated). A K,N=TILE of the
# vector form with one slice (``...k1s...pv``, ``pve``) sets that GEMM's
# columns, warps and early release where the layers run without norms.
set -u
out="${OUT:-/tmp/bubblefree-norms-in}"
mkdir -p "$out"
. bench/gpu_env.sh
tests_first "$out" "${TEST_SECONDS:-200}" -n 4 tests/test_normed_gemv.py tests/test_pdl_step.py \
  -k "${TEST_K:-normed or norm_kernels or float32_model_keeps or dependent_steps_layers or bf16}" \
  | tail -15

Q=896,1152 O=896,896 G=896,9728 D=4864,896
qwen05b="${QWEN05B:-base norms_in=1 norms_in=2 norms_in=4 norms_in=2+$G:1=8n128k1s4w1pve
  norms_in=1+max_splits=4 norms_in=1+max_splits=2 norms_in=1+split_block=64
  norms_in=1+split_warps=1 norms_in=1+split_warps=4 norms_in=1+$G=4n128k1s2w1pve
  norms_in=1+$G=2n128k1s1w1pve norms_in=1+$G=4n128k1s1w1pve base}"
llama1b="${LLAMA1B:-base norms_in=1 norms_in=2 base}"
ROWS="${ROWS:-1,2,4}" STEP_SECONDS="${STEP_SECONDS:-260}" step_ab_each "$out" "qwen05b llama1b"
if [ -n "${GRID:-}" ]; then
  MODELS="$GRID" OUT="$out/grid" bash bench/grid_run.sh
fi
exit 0
