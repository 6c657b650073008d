#!/usr/bin/env bash
# Trains the shipped zoo drafters from ../shared/data, one after another, resumable:
# rerun the same command after an interruption and every finished stage is reused.
#   bash bench/train_zoo.sh [DATA_ROOT] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
data_root=${1:-../shared/data}
steps=${2:-300}
for domain in code math translation summarization_qa chat general; do
  if [ -f "specpool/drafters/zoo/$domain/model.safetensors" ] && [ "${RETRAIN:-0}" != 1 ]; then
    echo "== $domain: already trained (RETRAIN=1 to redo)"; continue
  fi
  echo "== $domain: $(date -u +%H:%M:%S)"
  specpool zoo train --domain "$domain" --data-root "$data_root" --steps "$steps" --out "specpool/drafters/zoo/$domain" --resume
done
echo "== done $(date -u +%H:%M:%S)"
