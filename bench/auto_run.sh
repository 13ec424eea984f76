#!/usr/bin/env bash
# One call on a lent GPU: auto's per-tick choice against pipelined and
# blocking where it changed last (the choice at a tick's end, callers
# weighed: docs/performance.md, "Behind hands the ends to the caller
# first"). bench.speed's text, detect, point and mix for each shape
# (MODELS: phi llama1b qwen05b) at STREAMS (1,8), then the image grid's
# cells that missed (detect and query, 378 px, 8 streams) with three rounds
# of P B A A B P. Tables go to $OUT/benchmarks.md (copy the blocks back);
# everything printed is also written under $OUT.
#
# Knobs (environment): MODELS, STREAMS (1,8; 1,8,32,64 takes two calls),
# WORKLOADS (text,detect,point,mix), SPEED_SECONDS (130 a shape),
# VLM_SECONDS (150; 0: skip the image cells), VLM_ROUNDS (3).
set -u
out="${OUT:-/tmp/bubblefree-auto}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cp docs/benchmarks.md "$out/benchmarks.md"
{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__)"
} 2>&1 | tee "$out/env.txt"
secs="${SPEED_SECONDS:-130}"
for m in ${MODELS:-phi llama1b qwen05b}; do
  echo "== bench.speed --model $m"
  timeout -k 10 "$secs" python3 -m bubblefree.bench.speed --model "$m" --streams "${STREAMS:-1,8}" \
    --workloads "${WORKLOADS:-text,detect,point,mix}" --repeats 2 --peer-streams 1 \
    --budget $((secs * 6 / 10)) --deadline $((secs - 15)) --cell-timeout 40 --peer-timeout 30 \
    --out "$out/benchmarks.md" --plot "" 2>&1 | grep -v -i warn | tee "$out/speed-$m.txt"
done
if [ "${VLM_SECONDS:-150}" != 0 ]; then
  echo "== bench.vlm_speed: the image grid's 8-stream cells"
  timeout -k 10 "${VLM_SECONDS:-150}" python3 -m bubblefree.bench.vlm_speed --streams 8 --sizes 378 \
    --workloads detect,query --rounds "${VLM_ROUNDS:-3}" --no-peer --out "$out/benchmarks.md" \
    --record "$out/vlm-auto-$(date -u +%Y-%m-%d).json" 2>&1 | grep -v -i warn | tee "$out/vlm-speed.txt"
fi
exit 0
