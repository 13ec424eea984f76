#!/usr/bin/env bash
# One call on a lent GPU: the decode GEMMs letting the next kernel launch
# before they load their weights and wait (a tile's "e"; "ve" in the vector
# form, whose whole share is asked for before the wait), so that, as in
# bench.read_chain's hold-release chain, kernels several deep hold their
# weights while the one before them runs. The GPU tests of the GEMM's
# forms and of whole steps with every GEMM so launched, then bench.step_ab
# for each shape with the variants below (one process a shape), each
# shape's output to $OUT/steps-M.txt; then, if GRID names shapes, their
# whole grid in requests (bench/grid_run.sh, into $OUT/grid). About 450 s,
# and 185 s a shape of GRID.
#
# Knobs (environment): TESTS (1), TEST_SECONDS (150), TEST_K (the tests'
# -k), MODELS (qwen05b llama1b), STEP_SECONDS (240 a shape), ROWS (1,8),
# INCREMENTS (a variant of the first shape whose per-kernel increments to
# print), GRID (none), and a shape's variants in place of the lists below
# (QWEN05B, LLAMA1B, PHI; as step_ab's --variant takes them,
# space-separated).
set -u
out="${OUT:-/tmp/bubblefree-held}"
mkdir -p "$out"
. bench/gpu_env.sh
tests_first "$out" "${TEST_SECONDS:-150}" -n 4 tests/test_pdl_step.py tests/test_gemm_compiles.py \
  -k "${TEST_K:-gated_mlp or release or vector or measured or bf16}" | tail -15

# Qwen2-0.5B: q, k, v (sums to attention); o; gate and up; down; the head.
Q=896,1152 O=896,896 G=896,9728 D=4864,896 H=896,151936
V="$G=8n128k1s2w1pv+$D=32n256k19s2w1pv"
E="$Q=16n128k4s4w1pve+$G=8n128k1s2w1pve+$D=32n256k19s2w1pve"
qwen05b="${QWEN05B:-base $V $E $Q=16n128k4s4w1pve $G=8n128k1s2w1pve $D=32n256k19s2w1pve
  $E+$H=16n128k1s4w1pve $E+early_attention=1 $E+$H=16n128k1s4w1pve+early_attention=1
  $E+o_combines=0+$O=16n128k7s4w1pve $Q=16n128k4s4w1pve+$G=16n128k1s4w1pve+$D=32n256k19s2w1pve
  $Q=16n128k4s4w1pve+$G=8n128k1s4w1pve+$D=64n256k19s4w1pve base}"
# Llama-3.2-1B.
Q=2048,3072 G=2048,16384 D=8192,2048
llama1b="${LLAMA1B:-base $G=8n256k1s8w1pv+$D=64n256k32s4w1pv $G=8n256k1s8w1pve+$D=64n256k32s4w1pve
  $Q=32n256k8s4w1pve+$G=8n256k1s8w1pve+$D=64n256k32s4w1pve base}"
phi="${PHI:-base}"
STEP_SECONDS="${STEP_SECONDS:-240}" step_ab_each "$out" "qwen05b llama1b"
if [ -n "${GRID:-}" ]; then
  MODELS="$GRID" OUT="$out/grid" bash bench/grid_run.sh
fi
exit 0
