#!/usr/bin/env bash
# One call on a lent GPU: the warps of a (row, head) in one program
# (Dispatch.whole_warps) in Qwen2's one-row step. The tests of the kernel
# in one program, then bench.step_ab at contexts in buckets of 64, 128 and
# 256 keys (where the keys ask for 2, 4 and 8 warps) with 1 to 8 warps,
# then the one-stream text cell in requests with the defaults, each of
# SPEED_VARIANTS, and the defaults again. Two calls of about 400 s:
# SPEED=0, then TESTS=0 STEPS=0.
#
# Knobs (environment): TESTS (1), TEST_SECONDS (120), STEPS (1), CONTEXTS
# (48 100 128), QWEN05B (the variants, as step_ab's --variant takes them,
# space-separated), STEP_SECONDS (120 a context), SPEED (1),
# SPEED_VARIANTS (whole_warps=2 whole_warps=4), SPEED_SECONDS (80 a run).
set -u
out="${OUT:-/tmp/bubblefree-warps}"
mkdir -p "$out"
. bench/gpu_env.sh
tests_first "$out" "${TEST_SECONDS:-120}" -n 4 tests/test_whole_attention.py \
  tests/test_paged_launch.py tests/test_step_ab.py | tail -5

variants="${QWEN05B:-base whole_warps=1 whole_warps=2 whole_warps=4 whole_warps=8 base}"
[ "${STEPS:-1}" = 1 ] && for c in ${CONTEXTS:-48 100 128}; do
  args=()
  for v in $variants; do args+=(--variant "$v"); done
  echo "== bench.step_ab --model qwen05b --rows 1 --context $c" | tee "$out/steps-$c.txt"
  timeout -k 10 "${STEP_SECONDS:-120}" python3 -m bubblefree.bench.step_ab --model qwen05b \
    --rows 1 --context "$c" "${args[@]}" 2>&1 | quiet >> "$out/steps-$c.txt"
  grep -A12 "^| variant" "$out/steps-$c.txt"
done
[ "${SPEED:-1}" = 1 ] && for extra in "" ${SPEED_VARIANTS-whole_warps=2 whole_warps=4} ""; do
  echo "== bench.speed --model qwen05b ${extra:+--variant $extra}"
  env -u OUT timeout -k 10 "${SPEED_SECONDS:-80}" python3 -m bubblefree.bench.speed \
    --model qwen05b --streams 1 --workloads text --repeats 3 --peer-streams "" --out "" \
    --plot "" ${extra:+--variant "$extra"} 2>&1 | quiet | grep "^| text"
done | tee "$out/speed.txt"
exit 0
