#!/usr/bin/env bash
# One call on a lent GPU: bench.speed's whole grid (runs 28 to 31), the
# three shapes one after another, 1, 8, 32 and 64 streams, every workload,
# peers at 1 and 32 streams, each shape in its own process. Every run's
# line says where its steps went on the host (wait, host work, auto's
# choosing, collections); the per-cell JSON goes to $OUT/bench.jsonl
# (strip its tokens_by_request before keeping it under docs/runs/), each
# shape's output to $OUT/speed-M.txt. About 540 s: one call of its own.
#
# Knobs (environment): MODELS (phi llama1b qwen05b), SHAPE_SECONDS (185 a
# shape), REPEATS (3).
set -u
out="${OUT:-/tmp/bubblefree-grid}"
mkdir -p "$out"
export OUT="$out"
. bench/gpu_env.sh
machine > "$out/machine.txt" 2>&1
secs="${SHAPE_SECONDS:-185}"
for m in ${MODELS:-phi llama1b qwen05b}; do
  timeout -k 5 "$secs" python3 -m bubblefree.bench.speed --model "$m" --streams 1,8,32,64 \
    --repeats "${REPEATS:-3}" --peer-streams 1,32 --peer-timeout 30 --budget $((secs * 54 / 100)) \
    --deadline $((secs - 20)) --cell-timeout 30 --out '' --plot '' 2>&1 | quiet > "$out/speed-$m.txt"
  grep -h "auto >= " "$out/speed-$m.txt"
done
exit 0
