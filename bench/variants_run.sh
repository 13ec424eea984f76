#!/usr/bin/env bash
# One call on a lent GPU: kernel settings compared as whole steps and then
# in requests. The GPU tests (TEST_ARGS), then bench.step_ab's whole
# captured steps under each variant (VARIANTS, as its --variant takes them),
# then bench.speed's cells with the defaults and with the variant fastest
# at one row, where it beat the defaults. Each section's output goes to its
# own file under $OUT (three files). E.g.
#   VARIANTS="base 896,9728=16n128k1s4w3p" bash bench/variants_run.sh
#
# Knobs (environment): TESTS (1), TEST_SECONDS (200), TEST_ARGS (pytest's
# files and options), MODEL (qwen05b), VARIANTS (space-separated, base
# first), INCREMENTS (a variant whose kernels' increments to print),
# STEP_SECONDS (240), SPEED (1), SPEED_SECONDS (75 a run), STREAMS (1,8),
# WORKLOADS (text).
set -u
out="${OUT:-/tmp/bubblefree-variants}"
mkdir -p "$out"
. bench/gpu_env.sh
model="${MODEL:-qwen05b}"
variants="${VARIANTS:-base}"
{
  machine
  if [ "${TESTS:-1}" = 1 ]; then
    echo "== GPU tests"
    timeout -k 10 "${TEST_SECONDS:-200}" python3 -m pytest -p no:cacheprovider -p no:warnings -rs \
      --tb=short ${TEST_ARGS:-tests/test_pdl_step.py tests/test_o_combines.py \
      tests/test_sample_ahead.py tests/test_cuda_gpu.py} 2>&1
    echo "pytest exit status: $?"
  fi
} 2>&1 | quiet | tee "$out/tests.txt"
args=()
for v in $variants; do args+=(--variant "$v"); done
echo "== bench.step_ab --model $model" | tee "$out/steps.txt"
timeout -k 10 "${STEP_SECONDS:-240}" python3 -m bubblefree.bench.step_ab --model "$model" \
  --rows 1,8 "${args[@]}" ${INCREMENTS:+--increments "$INCREMENTS"} 2>&1 | quiet | tee -a "$out/steps.txt"
# The fastest variant at one row, from the table that ends the output.
read -r base best < <(awk -F'|' '/^\| / && $3 ~ /[0-9]/ {
    gsub(/ /, "", $2); gsub(/ /, "", $3)
    if ($2 == "base") b = $3 + 0; else if (v == "" || $3 + 0 < m) { m = $3 + 0; v = $2 } }
  END { print (b == "" ? "none" : b), (v != "" && b != "" && m < b ? v : "none") }' "$out/steps.txt")
{
  echo "fastest at one row: $best (base $base)"
  for extra in "" "$best"; do
    [ "$extra" = none ] || [ "${SPEED:-1}" != 1 ] && continue
    echo "== bench.speed --model $model ${extra:+--variant $extra}"
    env -u OUT timeout -k 10 "${SPEED_SECONDS:-75}" python3 -m bubblefree.bench.speed --model "$model" \
      --streams "${STREAMS:-1,8}" --workloads "${WORKLOADS:-text}" --repeats 3 --peer-streams "" \
      --out "" --plot "" ${extra:+--variant "$extra"} 2>&1
  done
} 2>&1 | quiet | tee "$out/speed.txt"
exit 0
