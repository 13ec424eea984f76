#!/usr/bin/env bash
# One call on a machine with two GPUs: the load grid against one replica,
# then against two (docs/benchmarks.md). Everything it prints is also
# written under $OUT.
#
# RAY=1: on Ray Serve, as a user runs it: `bubblefree serve --replicas 1`,
# then `--replicas 2`, each behind its one address (Ray's router spreads the
# requests); two load processes send to that address, and the load
# generator reads every replica's /v1/stats (`--replicas`). Ray comes from
# .raypack/raysite.tar.xz (bench/ray_pack.sh), unpacked into /tmp/site when
# `import ray` fails: the GPU machines have no network. Section "Load: one
# server against 2 on Ray Serve".
#
# Otherwise: two `bubblefree serve` processes, one per GPU, the load
# generator spreading the clients between them (client-side balancing, no
# Ray). Server B starts with server A, so their start-ups overlap; B serves
# nothing until the second grid. Section "Load: one server against 2".
#
# Expected: about 230 s (two processes) or 330 s (Ray: two start-ups), the
# full shape's start-up included. Every step runs under `timeout`, which
# bounds the whole at about 570 s.
#
# Knobs (environment): RAY (unset), CELL_SECONDS (4), WARMUP_SECONDS (2),
# CLIENTS (1,8,32,128), WORKLOADS (query,point), IMAGES (2048 a load
# process), START_SECONDS (150, for /health), GRID_SECONDS (100 each), SHAPE
# (moondream-full), DEVICE (cuda), PYTHON (python3), DOC
# (docs/benchmarks.md), RECORDS (docs/runs), WHEELS (.whl: installed into
# /tmp/site when fastapi or uvicorn is missing).
set -u
out="${OUT:-/tmp/bubblefree-load}"
mkdir -p "$out"
py="${PYTHON:-python3}"
shape="${SHAPE:-moondream-full}"
clients="${CLIENTS:-1,8,32,128}"
day="$(date -u +%Y-%m-%d)"
record="${RECORDS:-docs/runs}/load-replicas-$day.json"
[ -n "${RAY:-}" ] && record="${RECORDS:-docs/runs}/load-ray-$day.json"
note="Two replicas here are two separate \`bubblefree serve --random $shape --max-live 512 --log-level warning\` processes, one per GPU (CUDA_VISIBLE_DEVICES), the load generator spreading the clients between them (client-side balancing, no Ray; the same on Ray Serve: \`RAY=1 bash bench/load_run.sh\`, its own section)."
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
pids=()

stop_servers() {
  for pid in "${pids[@]}"; do kill -INT "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    echo "server (pid $pid) exit status: $?"
  done
  pids=()
}

serve_ray() {  # serve_ray N PORT: N replicas on Ray Serve in the background, the log under $out
  echo "Ray Serve: $1 replica(s), port $2"
  timeout -k 20 -s INT "${SERVER_SECONDS:-600}" "$py" -m bubblefree serve \
    --random "$shape" --device "${DEVICE:-cuda}" --port "$2" --max-live 512 --log-level warning --replicas "$1" \
    >"$out/server_ray$1.txt" 2>&1 &
  pids+=($!)
}

stop_ray() {
  stop_servers
  timeout 60 "$py" -m ray.scripts.scripts stop --force >/dev/null 2>&1
}

serve() {  # serve NAME GPU PORT: a server in the background, its log under $out
  echo "server $1: GPU $2, port $3"
  CUDA_VISIBLE_DEVICES="$2" timeout -k 10 -s INT "${SERVER_SECONDS:-600}" "$py" -m bubblefree serve \
    --random "$shape" --device "${DEVICE:-cuda}" --port "$3" --max-live 512 --log-level warning \
    >"$out/server_$1.txt" 2>&1 &
  pids+=($!)
}

healthy() {  # healthy SECONDS PID URL: URL answers /health; fails if PID ends or time runs out
  timeout -k 5 "$1" "$py" - "$2" "$3" <<'PY'
import json, sys, time, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
pid, url = sys.argv[1:]

def alive():  # an ended child stays a zombie until the shell reaps it
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

while alive():
    try:
        print(f"{url}: {json.load(opener.open(f'{url}/health', timeout=2))['model']}", flush=True)
        sys.exit(0)
    except OSError:
        time.sleep(1)
sys.exit(f"{url}: the server ended before it was healthy")
PY
}

grid() {  # grid LABEL RECORD REPLICAS URL...: REPLICAS behind each URL
  local label="$1" rec="$2" behind="$3"; shift 3
  local urls=(); for u in "$@"; do urls+=(--url "$u"); done
  echo "== $label"
  timeout -k 10 "${GRID_SECONDS:-100}" "$py" -m bubblefree.bench.load_grid "${urls[@]}" \
    --workloads "${WORKLOADS:-query,point}" --clients "$clients" --duration "${CELL_SECONDS:-4}" \
    --warmup "${WARMUP_SECONDS:-2}" --images "${IMAGES:-2048}" --max-tokens 10 --label "$label" \
    --replicas "$behind" --env "$machine" --record "$rec"
  echo "grid exit status: $?"
}

ray_main() {  # the grid against `serve --replicas 1`, then `--replicas 2`, on Ray Serve
  trap stop_ray EXIT
  local url=http://127.0.0.1:2020 limit="${START_SECONDS:-150}" n t0
  for n in 1 2; do
    t0=$SECONDS
    serve_ray "$n" 2020
    if ! healthy "$limit" "${pids[0]}" "$url"; then
      echo "Ray Serve with $n replica(s) did not come up (limit $limit s):"; tail -n 40 "$out/server_ray$n.txt"
      return 1
    fi
    echo "Ray Serve with $n replica(s) up after $((SECONDS - t0)) s"
    # Two load processes on the one address: one process's Python loop
    # saturates near 128 clients with images (load CPU ~1).
    grid "$n replica(s) on Ray Serve (serve --replicas $n)" "$out/grid_ray$n.json" "$n" "$url" "$url"
    stop_ray
  done
  tail -n 5 "$out"/server_ray*.txt
  mkdir -p "$(dirname "$record")"
  timeout 60 "$py" -m bubblefree.bench.load_compare "$out/grid_ray1.json" "$out/grid_ray2.json" --target 1.8 \
    --block load-ray --out "${DOC:-docs/benchmarks.md}" --record "$record"
}

main() {
  trap stop_servers EXIT
  date -u +"%Y-%m-%d %H:%M:%S UTC"
  [ -z "${RAY:-}" ] && echo "$note"
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>&1 | head -4
  if ! "$py" -c "import fastapi, uvicorn" 2>/dev/null; then
    echo "installing the server's wheels into /tmp/site"
    timeout 60 "$py" -m pip install -q --no-index --no-deps --target /tmp/site "${WHEELS:-.whl}"/*.whl 2>&1 | tail -3
  fi
  timeout 60 "$py" -c "import sys, torch, fastapi, uvicorn; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.cuda.is_available(), torch.cuda.device_count(), '| fastapi', fastapi.__version__, '| uvicorn', uvicorn.__version__)" || return 1
  if [ -n "${RAY:-}" ] && ! "$py" -c "import ray" 2>/dev/null; then
    echo "unpacking Ray into /tmp/site"
    mkdir -p /tmp/site && timeout 120 tar -C /tmp/site -xJf .raypack/raysite.tar.xz || return 1
  fi
  machine="$(nvidia-smi -L 2>/dev/null | wc -l)× $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $("$py" -c 'import torch; print("torch", torch.__version__)' 2>/dev/null), $day"
  if [ -n "${RAY:-}" ]; then
    timeout 60 "$py" -c "import ray, ray.serve; print('ray', ray.__version__)" || return 1
    ray_main
    cp "${DOC:-docs/benchmarks.md}" "$record" "$out/" 2>/dev/null
    echo "done after $SECONDS s"
    return
  fi
  local a=http://127.0.0.1:2020 b=http://127.0.0.1:2021 t0=$SECONDS limit="${START_SECONDS:-150}"
  serve A 0 2020
  serve B 1 2021
  if ! healthy "$limit" "${pids[0]}" "$a"; then
    echo "server A did not come up (limit $limit s):"; tail -n 30 "$out/server_A.txt"
    return 1
  fi
  echo "server A up after $((SECONDS - t0)) s"
  # B has had as long as A; the rest of the limit is its own.
  if ! healthy "$((limit > SECONDS - t0 ? limit - (SECONDS - t0) : 1))" "${pids[1]}" "$b"; then
    echo "server B did not come up (limit $limit s): the one-replica grid only"; tail -n 30 "$out/server_B.txt"
    b=""
  else
    echo "server B up after $((SECONDS - t0)) s"
  fi
  grid "one replica (server A alone)" "$out/grid_one.json" 1 "$a"
  [ -n "$b" ] && grid "two replicas (servers A and B, two processes, client-side balancing, no Ray)" \
    "$out/grid_two.json" 1 "$a" "$b"
  stop_servers
  tail -n 5 "$out"/server_*.txt
  mkdir -p "$(dirname "$record")"
  [ -n "$b" ] && timeout 60 "$py" -m bubblefree.bench.load_compare "$out/grid_one.json" "$out/grid_two.json" --target 1.8 \
    --note "$note" --out "${DOC:-docs/benchmarks.md}" --record "$record"
  cp "${DOC:-docs/benchmarks.md}" "$record" "$out/" 2>/dev/null
  echo "done after $SECONDS s"
}

main "$@" 2>&1 | tee "$out/load_run.txt"
exit 0
