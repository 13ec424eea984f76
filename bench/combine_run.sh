#!/usr/bin/env bash
# One call on a lent Hopper GPU: the output projection combining the split
# attention kernel's states (KernelConfig.o_combines) against the split
# kernel's own combining, for the Llama-3.2-1B and Qwen2-0.5B shapes. Its
# GPU tests (and with STEP_TESTS=1 the dependent step's whole-step tests),
# then per shape whole captured steps built in one process (bench.step_ab:
# the defaults, the same tiles without it, the output projection's tile
# before, other tiles with it; what each kernel adds at one row, with the
# defaults), then bench.speed's cells with and without it. Each section's
# output goes to its own file under $OUT (three files).
#
# Knobs (environment): MODELS (llama1b qwen05b), TEST_SECONDS (100 a file),
# STEP_TESTS (0), AB_SECONDS (110 a shape), AB_ROWS (1,2), SPEED_SECONDS
# (75 a run), STREAMS (1), WORKLOADS (text,point,detect).
set -u
out="${OUT:-/tmp/bubblefree-combine}"
mkdir -p "$out"
. bench/gpu_env.sh
{
  machine
  echo "== GPU tests"
  timeout -k 10 "${TEST_SECONDS:-100}" python3 -m pytest -p no:cacheprovider -p no:warnings -rs \
    --tb=short tests/test_o_combines.py 2>&1
  echo "pytest exit status: $?"
  if [ "${STEP_TESTS:-0}" = 1 ]; then  # its kernels' own tests take minutes more
    timeout -k 10 "${TEST_SECONDS:-100}" python3 -m pytest -p no:cacheprovider -p no:warnings \
      -rs --tb=short tests/test_pdl_step.py -k "dependent_step" 2>&1
    echo "pytest exit status: $?"
  fi
} 2>&1 | quiet | tee "$out/tests.txt"
for m in ${MODELS:-llama1b qwen05b}; do
  echo "== bench.step_ab --model $m"
  # The defaults (the output projection combining at one row, in its own
  # tile there); the same tile without it; the tile before; other tiles
  # with it (wider: fewer programs combine each head).
  if [ "$m" = llama1b ]; then
    o=2048,2048; before=64n256k8s4w3p; others="128n128k16s4w3p 128n256k8s8w3p"
  else
    o=896,896; before=32n64k8s4w3p; others="64n64k14s4w3p 32n64k7s4w3p2a"
  fi
  variants="--variant base --variant o_combines=0 --variant o_combines=0+$o=$before"
  for t in $others; do variants="$variants --variant $o=$t"; done
  timeout -k 10 "${AB_SECONDS:-110}" python3 -m bubblefree.bench.step_ab --model "$m" \
    --rows "${AB_ROWS:-1,2}" $variants --increments base 2>&1
done 2>&1 | quiet | tee "$out/steps.txt"
speed_ab --o-combines 0 ${MODELS:-llama1b qwen05b} 2>&1 | quiet | tee "$out/speed.txt"
exit 0
