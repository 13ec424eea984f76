#!/usr/bin/env bash
# One call on a lent GPU: the decode GEMM's vector form (a tile's "v",
# skinny_gemv: no MMA, each program's whole slice of the weights asked for
# before the wait) against the MMA tiles, as whole captured steps. The GPU
# tests of the GEMM's forms, then bench.step_ab for each shape with the
# variants below (one process a shape), each shape's output to
# $OUT/steps-M.txt. About 450 s.
#
# Knobs (environment): TESTS (1), TEST_SECONDS (120), TEST_K (gemm), MODELS (qwen05b
# llama1b), STEP_SECONDS (200 a shape), ROWS (1,8), INCREMENTS (a variant
# of the first shape whose per-kernel increments to print), and a shape's
# variants in place of the lists below (QWEN05B, LLAMA1B; as step_ab's
# --variant takes them, space-separated).
set -u
out="${OUT:-/tmp/bubblefree-vector}"
mkdir -p "$out"
. bench/gpu_env.sh
tests_first "$out" "${TEST_SECONDS:-120}" tests/test_pdl_step.py tests/test_cuda_gpu.py \
  -k "${TEST_K:-gemm}"

# Qwen2-0.5B: q, k, v (sums to attention); gate and up; down; the head.
Q=896,1152 G=896,9728 D=4864,896 H=896,151936
qwen05b="${QWEN05B:-base $G=16n128k1s4w1pv $G=16n128k1s8w1pv $G=8n128k1s4w1pv $G=8n128k1s2w1pv
  $G=32n128k1s8w1pv $D=64n256k19s4w1pv $D=32n256k19s4w1pv $D=64n128k38s4w1pv $D=32n256k19s2w1pv
  $Q=16n128k7s4w1pv $Q=32n128k4s4w1pv $H=32n128k1s8w1pv $H=16n128k1s4w1pv
  $G=16n128k1s8w1pv+$D=64n256k19s4w1pv $G=8n128k1s4w1pv+$D=32n256k19s4w1pv
  $G=16n128k1s8w1pv+$D=64n256k19s4w1pv+$Q=16n128k7s4w1pv}"
# Llama-3.2-1B.
Q=2048,3072 G=2048,16384 D=8192,2048 H=2048,128256
llama1b="${LLAMA1B:-base $G=8n256k1s8w1pv $G=16n256k1s8w1pv $G=8n256k1s4w1pv
  $D=64n256k32s4w1pv $D=32n256k32s4w1pv $D=64n256k16s8w1pv $Q=32n256k8s4w1pv $Q=16n256k8s4w1pv
  $H=32n256k1s8w1pv $G=8n256k1s8w1pv+$D=64n256k32s4w1pv}"

step_ab_each "$out" "qwen05b llama1b"
exit 0
