#!/usr/bin/env bash
# One call on a lent GPU: a step's chain of kernels that only read
# (bench.read_chain) beside the step itself. The read chain's GPU tests,
# then read_chain for every shape into $OUT/chain.txt, then each shape's
# captured step (bench.step_ab, defaults only) into $OUT/steps-M.txt, with
# the first shape's per-kernel increments. About 400 s.
#
# Knobs (environment): TESTS (1), TEST_SECONDS (90), MODELS (qwen05b
# llama1b phi), CHAIN_SECONDS (360), CONTEXT (128), STEP_SECONDS (200 a
# shape), ROWS (1).
set -u
out="${OUT:-/tmp/bubblefree-chain}"
mkdir -p "$out"
. bench/gpu_env.sh
tests_first "$out" "${TEST_SECONDS:-90}" tests/test_read_chain.py | tail -5
models="${MODELS:-qwen05b llama1b phi}"
timeout -k 10 "${CHAIN_SECONDS:-360}" python3 -m bubblefree.bench.read_chain \
  --models "${models// /,}" --context "${CONTEXT:-128}" 2>&1 | quiet | tee "$out/chain.txt"
qwen05b=base llama1b=base phi=base ROWS="${ROWS:-1}" INCREMENTS=base step_ab_each "$out" "$models"
exit 0
