# Sourced by the one-call GPU scripts (bench/*_run.sh): the environment
# every one of them runs in, the filter for their records, and the lines
# naming the machine and versions that open each record.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
quiet() { grep -v -i -e warn -e USDT; }
machine() {
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
}
# bench.speed's cells for each model, with the defaults and then with FLAG
# ROWS (e.g. --sample-ahead 0): speed_ab FLAG ROWS MODEL... Knobs:
# SPEED_SECONDS (75 a run), STREAMS (1), WORKLOADS (text,point,detect).
speed_ab() {
  local flag="$1" rows="$2" m extra
  shift 2
  for m in "$@"; do
    for extra in "" "$flag $rows"; do
      echo "== bench.speed --model $m $extra"
      env -u OUT timeout -k 10 "${SPEED_SECONDS:-75}" python3 -m bubblefree.bench.speed --model "$m" \
        --streams "${STREAMS:-1}" --workloads "${WORKLOADS:-text,point,detect}" --repeats 3 \
        --peer-streams "" --out "" --plot "" $extra 2>&1
    done
  done
}
# The GPU tests of a one-call script, under a time limit, and their exit
# status: gpu_tests SECONDS PYTEST_ARGS...
gpu_tests() {
  local secs="$1"
  shift
  echo "== GPU tests"
  timeout -k 10 "$secs" python3 -m pytest -p no:cacheprovider -p no:warnings -rs --tb=short "$@" 2>&1
  echo "pytest exit status: $?"
}
# A one-call script's first record: the machine's lines, then (unless
# TESTS=0) its GPU tests under SECONDS, into DIR/tests.txt, printed as they
# run: tests_first DIR SECONDS PYTEST_ARGS...
tests_first() {
  local dir="$1" secs="$2"
  shift 2
  { machine; [ "${TESTS:-1}" = 1 ] && gpu_tests "$secs" "$@"; } 2>&1 | quiet | tee "$dir/tests.txt"
}
# bench.step_ab for each shape of MODELS (else the list given), one process
# a shape, its variants the list in the variable named after it
# (space-separated, as --variant takes them), its output to
# OUT_DIR/steps-M.txt and its table printed: step_ab_each OUT_DIR MODELS.
# Knobs: STEP_SECONDS (200 a shape), ROWS (1,8), INCREMENTS (a variant of
# the first shape whose per-kernel increments to print).
step_ab_each() {
  local dir="$1" models="${MODELS:-$2}" m v
  for m in $models; do
    local args=() inc=()
    for v in ${!m}; do args+=(--variant "$v"); done
    [ -n "${INCREMENTS:-}" ] && [ "$m" = "${models%% *}" ] && inc=(--increments "$INCREMENTS")
    echo "== bench.step_ab --model $m" > "$dir/steps-$m.txt"
    timeout -k 10 "${STEP_SECONDS:-200}" python3 -m bubblefree.bench.step_ab --model "$m" \
      --rows "${ROWS:-1,8}" "${args[@]}" "${inc[@]}" 2>&1 | quiet >> "$dir/steps-$m.txt"
    grep -A30 "^| variant" "$dir/steps-$m.txt"
  done
}
