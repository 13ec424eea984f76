#!/usr/bin/env bash
# One call on a lent GPU: the norms releasing the next kernel early
# (KernelConfig.early_norms), with the GEMMs after them reading more of
# their weights before their wait (a tile's steps ahead), as whole captured
# steps. The GPU tests of the norm's early release, then bench.step_ab for
# each shape with the variants below (one process a shape), each shape's
# output to $OUT/steps-M.txt. About 500 s.
#
# Knobs (environment): TESTS (1), TEST_SECONDS (90), MODELS (qwen05b
# llama1b phi), STEP_SECONDS (200 a shape), ROWS (1,8), and a shape's
# variants in place of the lists below (QWEN05B, LLAMA1B, PHI; as
# step_ab's --variant takes them, space-separated).
set -u
out="${OUT:-/tmp/bubblefree-early}"
mkdir -p "$out"
. bench/gpu_env.sh
tests_first "$out" "${TEST_SECONDS:-90}" tests/test_gemm_compiles.py tests/test_pdl_step.py \
  -k "early or add_norm or compiles"

E=early_norms=8
# Qwen2-0.5B: q, k, v; gate and up; down; the head.
Q=896,1152 G=896,9728 D=4864,896 H=896,151936
qwen05b="${QWEN05B:-base $E early_norms=1 $G=32n128k1s4w3p2a $G=32n128k1s8w3p4a $D=64n128k8s8w3p4a
  $E+$G=32n128k1s4w3p2a $E+$G=32n128k1s8w3p2a $E+$G=32n128k1s8w3p4a $E+$G=16n128k1s4w3p4a
  $E+$G=16n128k1s8w3p4a $E+$G=64n128k1s8w3p2a $E+$G=16n64k1s4w3p8a
  $E+$D=64n128k8s4w3p2a $E+$D=64n128k8s4w3p4a $E+$D=64n128k8s8w3p4a $E+$D=32n128k8s4w3p4a
  $E+$Q=32n128k2s4w3p2a $E+$Q=32n128k1s4w3p4a $E+$H=64n128k1s4w3p4a
  $E+$G=32n128k1s8w3p4a+$D=64n128k8s8w3p4a $E+$G=16n128k1s8w3p4a+$D=64n128k8s8w3p4a
  $E+$G=32n128k1s8w3p4a+$D=64n128k8s4w3p2a $E+$G=16n128k1s8w3p4a+$D=64n128k8s4w3p2a
  $G=32n128k1s8w3p4a+$D=64n128k8s8w3p4a}"
# Llama-3.2-1B.
Q=2048,3072 G=2048,16384 D=8192,2048
llama1b="${LLAMA1B:-base $E early_norms=1 $G=32n256k1s8w3p2a $D=64n256k8s8w3p4a
  $E+$G=32n256k1s4w3p2a $E+$G=32n256k1s8w3p2a $E+$G=32n256k1s8w3p4a $E+$G=16n256k1s8w3p4a
  $E+$G=16n256k1s4w3p2a $E+$G=32n128k1s8w3p4a $E+$G=64n128k1s8w3p2a
  $E+$D=64n256k8s4w3p2a $E+$D=64n256k8s8w3p4a $E+$D=64n128k8s8w3p4a
  $E+$Q=64n256k4s8w3p2a $E+$Q=64n256k2s8w3p4a
  $E+$G=32n256k1s8w3p2a+$D=64n256k8s8w3p4a $E+$G=16n256k1s8w3p4a+$D=64n256k8s8w3p4a
  $E+$G=32n256k1s8w3p2a+$D=64n256k8s4w3p2a $E+$G=16n256k1s8w3p4a+$D=64n256k8s4w3p2a}"
# Phi-1.5: the fused q, k, v and fc1; the fused dense and fc2.
F=2048,14336 O=10240,2048
phi="${PHI:-base $E early_norms=1 $E+$F=64n128k1s4w3p2a $E+$F=64n128k1s8w3p4a $E+$F=32n128k1s8w3p4a
  $E+$O=64n256k8s8w3p4a $E+$O=64n256k8s4w3p2a $O=64n256k8s8w3p4a}"

step_ab_each "$out" "qwen05b llama1b phi"
exit 0
