#!/usr/bin/env bash
# One call on a lent GPU: moondream2's image path. Its GPU tests, the image-prefill
# profile (PROFILE_MODES: "graphs", or "eager" for the prefill before its
# graphs; both: "eager graphs"), then bench.vlm_speed (point, detect, caption, query
# at 378 and 756 px, 1, 8 and 32 streams; pipelined, blocking, auto; the
# transformers VLM peer). Everything printed is also written under $OUT,
# with docs/benchmarks.md updated there (copy its block back).
#
# Knobs (environment): VLM_TESTS (the image path's test files run first;
# empty: none), TEST_SECONDS (240), PROFILE_MODES (graphs), PROFILE_SECONDS
# (90 each), VLM_SECONDS (420), VLM_BUDGET (VLM_SECONDS - 120: no cell, nor
# the peer, starts after it, so the table is written), PROFILE_ARGS, VLM_ARGS (--tiny and --quick
# --no-peer: a CPU smoke run; --crops-on-host: images cut by Pillow on the callers' threads),
# LLAVA_SECONDS (180; 0: skip bench.llava_speed, the peer's LLaVA served by cuda_backend/vlm).
set -u
out="${OUT:-/tmp/bubblefree-vlm}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cp docs/benchmarks.md "$out/benchmarks.md"
day="$(date -u +%Y-%m-%d)"
{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__)"
} 2>&1 | tee "$out/env.txt"
if [ -n "${VLM_TESTS-tests/test_moondream_gpu.py tests/test_resample.py tests/test_moondream_crops.py tests/test_vlm_gpu.py}" ]; then
  echo "== GPU tests of the image path"
  timeout -k 10 "${TEST_SECONDS:-240}" python3 -m pytest -p no:cacheprovider -p no:warnings -rs \
    ${VLM_TESTS-tests/test_moondream_gpu.py tests/test_resample.py tests/test_moondream_crops.py tests/test_vlm_gpu.py} 2>&1 \
    | grep -v -i warn | tee "$out/gpu-tests.txt"
fi
for mode in ${PROFILE_MODES:-graphs}; do  # graphs, eager (the prefill before its graphs)
  echo "== vlm_profile, prefill: $mode"
  flag=""; [ "$mode" = eager ] && flag=--eager-prefill
  timeout -k 10 "${PROFILE_SECONDS:-90}" python3 -m bubblefree.bench.vlm_profile --streams 1,16 --requests 8 $flag ${PROFILE_ARGS:-} \
    2>&1 | grep -v -i -e warn -e USDT | tee -a "$out/vlm-profile.txt"
done
echo "== vlm_speed"
timeout -k 10 "${VLM_SECONDS:-420}" python3 -m bubblefree.bench.vlm_speed --streams 1,8,32 --sizes 378,756 \
  --per-stream 3 --budget "${VLM_BUDGET:-$(( ${VLM_SECONDS:-420} - 120 ))}" \
  --out "$out/benchmarks.md" --record "$out/vlm-run-$day.json" ${VLM_ARGS:-} 2>&1 \
  | grep -v -i warn | tee "$out/vlm-speed.txt"
if [ "${LLAVA_SECONDS:-180}" != 0 ]; then
  echo "== llava_speed (the peer's LLaVA served, against its generate)"
  timeout -k 10 "${LLAVA_SECONDS:-180}" python3 -m bubblefree.bench.llava_speed --streams 1,8,32 --tokens 3,10 \
    --out "$out/benchmarks.md" --record "$out/llava-run-$day.json" 2>&1 | grep -v -i warn | tee "$out/llava-speed.txt"
fi
cp docs/benchmarks*.png "$out/" 2>/dev/null
exit 0
