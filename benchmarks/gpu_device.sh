#!/usr/bin/env bash
# There, on the device machine (run tool: `bash benchmarks/gpu_device.sh`, carry [".whl"]): install the carried
# wheels and this checkout, then `benchmarks.gpu_check --json` (its stages alone, then its local swarm), then the
# test modules that touch the llama/CUDA paths, with CUDA visible. Results in $OUT. About 2.5 minutes on an H200.
export PYTHONUNBUFFERED=1
t0=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed (run benchmarks/gpu_wheels.sh here first)"; exit 3; }
export PYTHONPATH=/tmp/site
chmod +x /tmp/site/hivemind/hivemind_cli/p2pd
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 4; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, hivemind; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'hivemind', hivemind.__version__)"
timeout 300 python3 -m benchmarks.gpu_check --json > "$OUT/gpu_check.json" 2> "$OUT/gpu_check.err"
echo "gpu_check rc=$? at $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/gpu_check.err"
python3 -c "import json, sys; r = json.load(open(sys.argv[1])); s = r.pop('stages'); print(json.dumps(r)); [print(json.dumps(x)) for x in s]" "$OUT/gpu_check.json"
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_memory.py tests/test_llama.py tests/test_models.py \
  tests/test_hf_export.py tests/test_llm_swarm.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -3 "$OUT/tests.log"
echo "total $(( $(date +%s) - t0 )) s"
