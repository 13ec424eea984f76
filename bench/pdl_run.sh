#!/usr/bin/env bash
# One call on a lent Hopper GPU: the dependent-launch decode step (pdl_step).
# Its GPU tests, then for each shape (MODELS: phi llama1b qwen05b) the GEMM
# tiles (bench.pdl_tune, saved as JSON) and whole steps without and with it
# at 1, 8 and 32 rows, built in the same process (bench.profile_step --pdl
# 0,8 with those tiles); then each shape's step with the split attention
# kernel reading its keys after the wait (prefetch off), as by default (before
# it), and with its last programs combining (KernelConfig.last_combines),
# and what each kernel of its step at one row adds (bench.step_increments).
# Everything printed is also written under $OUT: a
# text file and the tiles per shape, eight files for the three shapes.
#
# Knobs (environment): MODELS, TEST_SECONDS (150), TUNE=0 (skip the tiles
# and the with-and-without profiles), TUNE_SECONDS (100 a
# shape), PROFILE_SECONDS (95 a shape), PDL_ROWS (8: the buckets it runs),
# TUNE_ARGS (e.g. --wide: a larger grid; give it more TUNE_SECONDS).
set -u
out="${OUT:-/tmp/bubblefree-pdl}"
mkdir -p "$out"
. bench/gpu_env.sh
{
  machine
} 2>&1 | tee "$out/env.txt"
echo "== GPU tests of the dependent-launch step"
timeout -k 10 "${TEST_SECONDS:-150}" python3 -m pytest -p no:cacheprovider -p no:warnings -rs tests/test_pdl_step.py 2>&1 \
  | grep -v -i warn | tee "$out/gpu-tests.txt"
for m in ${MODELS:-phi llama1b qwen05b}; do
  [ "${TUNE:-1}" = 0 ] && break  # the attention comparison alone
  echo "== bench.pdl_tune --model $m"
  timeout -k 10 "${TUNE_SECONDS:-100}" python3 -m bubblefree.bench.pdl_tune --model "$m" --rows 1,8 \
    ${TUNE_ARGS:-} --save "$out/pdl-tiles-$m.json" 2>&1 | grep -v -i warn | tee "$out/$m.txt"
  tiles=""; [ -f "$out/pdl-tiles-$m.json" ] && tiles="--pdl-tiles $out/pdl-tiles-$m.json"
  echo "== bench.profile_step --model $m --pdl 0,${PDL_ROWS:-8}"
  timeout -k 10 "${PROFILE_SECONDS:-95}" python3 -m bubblefree.bench.profile_step --model "$m" --rows 1,8,32 \
    --paths fused+compile --pdl "0,${PDL_ROWS:-8}" $tiles --kernels-at 1 2>&1 \
    | grep -v -i -e warn -e USDT | tee -a "$out/$m.txt"
done
for m in ${MODELS:-phi llama1b qwen05b}; do
  echo "== bench.profile_step --model $m --attention no-prefetch,default,last-combines"
  timeout -k 10 "${PROFILE_SECONDS:-95}" python3 -m bubblefree.bench.profile_step --model "$m" --rows 1,8 \
    --paths fused+compile --attention no-prefetch,default,last-combines 2>&1 \
    | grep -v -i -e warn -e USDT | tee -a "$out/$m.txt"
  echo "== bench.step_increments --model $m --rows 1"
  timeout -k 10 "${PROFILE_SECONDS:-95}" python3 -m bubblefree.bench.step_increments --model "$m" \
    --rows 1 2>&1 | grep -v -i -e warn -e USDT | tee -a "$out/$m.txt"
done
exit 0
