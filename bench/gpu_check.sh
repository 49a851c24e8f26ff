#!/bin/sh
# bench/gpu_check.py on the device, from the repo root: the GPU, the versions, then the check.
#   OUT=/path/to/out sh bench/gpu_check.sh [extra gpu_check.py arguments, e.g. --sections b,c]
# A wheel folder .whl/ (transformers newer than the image's) is installed into /tmp/site first.
# BUDGET (default 420 s) is the check's own budget; TIMEOUT (default 500 s) kills it past that.
set -u
OUT=${OUT:-gpu_check_out}
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || echo "wheel install failed"
fi
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
python3 - <<'PY' || true
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "triton", "transformers", "accelerate", "peft", "pydantic", "tokenizers", "safetensors"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as e:  # pydantic is needed by passkey, lora (recipe) and the verdicts
        print(name, "MISSING:", type(e).__name__, e)
import torch
print("cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
PY
timeout "${TIMEOUT:-500}" python3 bench/gpu_check.py --out "$OUT" --budget-s "${BUDGET:-420}" "$@"
rc=$?
echo "gpu_check exit $rc"
# issue 38: the LoRA step with the new memory stack at 128k, 256k, 512k (needs DeepSpeed for the tilings;
# LORA_STACK=0 skips it)
if [ "${LORA_STACK:-1}" = 1 ]; then
    timeout "${STACK_TIMEOUT:-400}" python3 bench/lora_stack.py --out "$OUT" || echo "lora_stack exit $?"
fi
exit $rc
