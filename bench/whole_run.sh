#!/usr/bin/env bash
# One call on a lent GPU: a (row, head) of decode attention in one program
# (Dispatch.whole_rows, paged_decode.whole_attention) against the split
# kernel. The GPU tests of the kernel and of whole steps, then
# bench.step_ab for each shape with the variants below (one process a
# shape, into $OUT/steps-M.txt), then Qwen2's one-stream text cell in
# requests with the defaults and with SPEED_VARIANT (into $OUT/speed.txt).
# About 500 s.
#
# Knobs (environment): TEST_SECONDS (200), MODELS (qwen05b llama1b phi),
# STEP_SECONDS (150 a shape), ROWS (1,2,4,8), INCREMENTS (a variant of the
# first shape whose per-kernel increments to print), a shape's variants in
# place of the lists below (QWEN05B, LLAMA1B, PHI; as step_ab's --variant
# takes them, space-separated), SPEED_VARIANT (whole_rows=1; empty: no
# requests), SPEED_SECONDS (90 a run).
set -u
out="${OUT:-/tmp/bubblefree-whole}"
mkdir -p "$out"
. bench/gpu_env.sh
tests_first "$out" "${TEST_SECONDS:-200}" -n 4 tests/test_whole_attention.py \
  tests/test_paged_launch.py tests/test_cuda_gpu.py tests/test_pdl_step.py \
  -k "${TEST_K:-whole or head or paged or rotary or activation or last_programs or before_the_wait}" \
  | tail -15

qwen05b="${QWEN05B:-base whole_rows=1 whole_rows=2 whole_rows=8 base}"
llama1b="${LLAMA1B:-base whole_rows=1 whole_rows=2 whole_rows=8}"
phi="${PHI:-base whole_rows=1 whole_rows=2 whole_rows=8}"
ROWS="${ROWS:-1,2,4,8}" STEP_SECONDS="${STEP_SECONDS:-150}" \
  step_ab_each "$out" "qwen05b llama1b phi"
speed_variant="${SPEED_VARIANT-whole_rows=1}"
if [ -n "$speed_variant" ]; then
  for extra in "" "$speed_variant"; do
    echo "== bench.speed --model qwen05b ${extra:+--variant $extra}"
    env -u OUT timeout -k 10 "${SPEED_SECONDS:-90}" python3 -m bubblefree.bench.speed \
      --model qwen05b --streams 1 --workloads text --repeats 3 --peer-streams "" --out "" \
      --plot "" ${extra:+--variant "$extra"} 2>&1 | quiet
  done | tee "$out/speed.txt"
fi
exit 0
