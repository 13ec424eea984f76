#!/usr/bin/env bash
# One call on a lent GPU: the split attention kernel releasing the output
# projection early (KernelConfig.early_attention), on by default for
# Llama-3.2-1B at one row, checked and measured in requests. The GPU tests
# of whole steps with it (tiny models, and each measured shape's tokens in
# bf16 on its defaults), then bench.speed's grid for Llama-3.2-1B
# (grid_run.sh) and each shape's per-kernel increments at one row on its
# defaults (bench.step_increments). Outputs under $OUT. About 310 s.
#
# Knobs (environment): TESTS (1), TEST_SECONDS (150), GRID (llama1b; empty
# for none), INCREMENTS (qwen05b llama1b; empty for none).
set -u
out="${OUT:-/tmp/bubblefree-attention}"
mkdir -p "$out"
. bench/gpu_env.sh
tests_first "$out" "${TEST_SECONDS:-150}" -n 4 tests/test_o_combines.py tests/test_pdl_step.py \
  -k "tokens or dependent_step or early or combin" | tail -15
if [ -n "${GRID-llama1b}" ]; then
  MODELS="${GRID-llama1b}" OUT="$out/grid" bash bench/grid_run.sh
fi
for m in ${INCREMENTS-qwen05b llama1b}; do
  timeout -k 5 90 python3 -m bubblefree.bench.step_increments --model "$m" --rows 1 2>&1 \
    | quiet > "$out/increments-$m.txt"
  tail -3 "$out/increments-$m.txt"
done
exit 0
