#!/usr/bin/env bash
# One call on a lent GPU: the GPU-only tests (every test marked gpu, which
# tests/conftest.py derives from the skip reasons, then the files whose tests
# run on the GPU where there is one and on the CPU elsewhere), the decode-step
# profile, then the speed benchmark. Everything it prints is also written
# under $OUT. GPU_TESTS selects tests (-k expression; empty = all);
# PROFILE_ARGS adds to the profile's arguments (e.g. --attention, --gemm);
# BENCH names the benchmark module (default speed; api_speed is the serving
# layer against the core); its arguments are this script's.
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
out="${OUT:-/tmp/bubblefree-gpu}"
mkdir -p "$out"
{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| transformers', transformers.__version__)"
} 2>&1 | tee "$out/env.txt"
# The GGUF loader tests need the embedded model's package, which this machine
# lacks; they run in CI on the CPU.
{
  timeout "${TEST_SECONDS:-420}" python3 -m pytest -p no:cacheprovider -p no:warnings -rs \
    --junitxml="$out/gpu_tests.xml" -k "${GPU_TESTS:-}" -m gpu tests/ 2>&1
  echo "pytest exit status (gpu-marked): $?"
  timeout "${TEST_SECONDS:-420}" python3 -m pytest -p no:cacheprovider -p no:warnings -rs \
    --junitxml="$out/device_tests.xml" -k "${GPU_TESTS:-}" \
    tests/test_cuda_fused.py tests/test_cuda_parity.py tests/test_cuda_attention.py \
    tests/test_cuda_sampling.py tests/test_cuda_backend.py tests/test_skinny_tiles.py \
    tests/test_paged_launch.py tests/test_rope_attention.py tests/test_kernel_config.py \
    tests/test_backend_contract.py 2>&1
  echo "pytest exit status (on the device where there is one): $?"
} | tee "$out/gpu_tests.txt"
# A section whose seconds are 0 is skipped (timeout would read 0 as no limit).
if [ "${PROFILE_SECONDS:-150}" != 0 ]; then
  timeout "${PROFILE_SECONDS:-150}" python3 -m bubblefree.bench.profile_step --rows 1,8,32,64 \
    --paths "${PROFILE_PATHS:-transformers,fused,fused+compile}" ${PROFILE_ARGS:-} 2>&1 | grep -v -i warn \
    | tee "$out/profile.txt"
fi
if [ "${BENCH_SECONDS:-420}" != 0 ]; then
  timeout "${BENCH_SECONDS:-420}" python3 -m "bubblefree.bench.${BENCH:-speed}" "$@" 2>&1 | tee "$out/bench.txt"
fi
cp docs/benchmarks.md docs/benchmarks.png "$out/" 2>/dev/null
exit 0
