#!/usr/bin/env bash
# On a lent GPU: every GPU test (the sampling graphs are three kinds a slot
# and bucket now: greedy, drawn, drawn and cut), a step's sampling alone at
# Qwen2's vocabulary beside transformers' (bench.sampling), and the text
# workload greedy and drawn at temperature 0.7 and top_p 0.9 in requests,
# the peers drawing alike (bench.speed --workloads text,sampled). The tests
# take about 330 s and the rest about 300: two calls, TESTS=1 SPEED=0
# SAMPLING=0 then TESTS=0.
#
# Knobs (environment): TESTS (1), SAMPLING (1), SPEED (1), TEST_SECONDS
# (330), MODELS (qwen05b), STREAMS (1,8,32,64), SPEED_SECONDS (280 a shape),
# WORKLOADS (text,sampled), VARIANT (none: the kernels' settings as
# bench.speed's --variant takes them). A third call, TESTS=0 SAMPLING=0
# WORKLOADS=sampled VARIANT=draw_kernel=0, times the requests with the
# drawn steps' noise in torch, as before KernelConfig.draw_kernel
# (bench.sampling times both paths already). KernelConfig.cut_kernel (off
# until measured): bench.sampling times its two kernels beside the rest,
# and a call with TESTS=0 SAMPLING=0 WORKLOADS=sampled VARIANT=cut_kernel=1
# times the requests with it, the run without it in the call before.
set -u
out="${OUT:-/tmp/bubblefree-sampling}"
mkdir -p "$out"
. bench/gpu_env.sh
{ machine; [ "${TESTS:-1}" = 1 ] && PYTEST_ADDOPTS="-n 4" TEST_SECONDS="${TEST_SECONDS:-330}" \
    PROFILE_SECONDS=0 BENCH_SECONDS=0 OUT="$out/tests" bash bench/gpu_run.sh | grep "exit status\|passed\|failed"; } \
  2>&1 | quiet | tee "$out/tests.txt"
if [ "${SAMPLING:-1}" = 1 ]; then
  timeout -k 10 120 python3 -m bubblefree.bench.sampling --out "$out/sampling.md" 2>&1 | quiet \
    | tee "$out/sampling.txt"
fi
if [ "${SPEED:-1}" = 1 ]; then
  secs="${SPEED_SECONDS:-280}"
  variant=()
  [ -n "${VARIANT:-}" ] && variant=(--variant "$VARIANT")
  for m in ${MODELS:-qwen05b}; do
    timeout -k 10 "$secs" python3 -m bubblefree.bench.speed --model "$m" --streams "${STREAMS:-1,8,32,64}" \
      --workloads "${WORKLOADS:-text,sampled}" --repeats 3 --budget $((secs - 90)) \
      --deadline $((secs - 20)) --out "$out/speed-$m${VARIANT:+-variant}.md" --plot "" "${variant[@]}" 2>&1 \
      | quiet > "$out/speed-$m${VARIANT:+-variant}.txt"
    grep "^| " "$out/speed-$m${VARIANT:+-variant}.txt"
  done
fi
exit 0
