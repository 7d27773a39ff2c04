#!/usr/bin/env bash
# Here, before a GPU session's first device call: the cp312 wheels of what the device image lacks (hivemind and its
# dependencies, textual, pydantic, ...) into .whl/ (git-excluded), for benchmarks/gpu_device.sh to install there.
# The device image has torch, numpy, scipy, transformers, tokenizers, safetensors, psutil, scikit-learn, msgpack,
# uvloop, grpcio, pytest, pytest-timeout and pytest-xdist (/work/.library/device/KINDS.md); it reaches no registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
# name==version as this checkout's virtualenv has them (the versions the suite passed with)
pins=$($PY -m pip list --format=freeze 2>/dev/null | tr "_" "-" | grep -iE '^(annotated-types|base58|blake3|cffi|configargparse|cryptography|hivemind|linkify-it-py|mdit-py-plugins|mmh3|morphys|netaddr|platformdirs|prefetch-generator|py-cid|py-multibase|py-multicodec|py-multihash|pycparser|pydantic|pydantic-core|python-baseconv|textual|typing-inspection|varint|protobuf|uc-micro-py|pytest-asyncio|pyte|wcwidth|py-spy)==')
platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
for pin in $pins uc-micro-py; do
  # shellcheck disable=SC2086
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms -d .whl "$pin" \
    >/dev/null 2>&1 || $PY -m pip wheel -q --no-deps -w .whl "$pin" >/dev/null 2>&1 || echo "no wheel for $pin"
done
ls .whl | wc -l | xargs echo "wheels in .whl:"; du -sh .whl
