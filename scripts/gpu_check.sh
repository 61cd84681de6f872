#!/usr/bin/env bash
# The GPU device check, in one call on a CUDA machine without network (docs/gpu.md):
#   1. install the wheels `make gpu-wheels` carried (.gpu-wheels/) and put services/ on the path
#   2. pytest -m gpu (engine vs HF, learner on CUDA, ZeRO-2 on one GPU, cuda_ipc hand-off)
#   3. benchmarks/engine.py --device cuda (built-in engine vs HF generate, a 0.5B Qwen2 shape, and
#      its host work per decode step at 8, 64 and 256 rows)
#   4. benchmarks/weight_update.py --device cuda (update stall vs one device copy, 0.5B and 1.5B)
#   5. a short `pipelinerl run --device cuda` on the 100M preset, checked: every attempt once
# Logs and the JSON line of each step land in $OUT (summary.txt has them all); a step that fails
# does not stop the next. GPU_CHECK_STEPS picks steps ("tests engine weights run" by default);
# GPU_CHECK_DEVICE=cpu GPU_CHECK_MODEL=tiny rehearses the run step on a CPU machine.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
PYTHON=${PYTHON:-python3}
STEPS=${GPU_CHECK_STEPS:-tests engine weights run}
RUN_S=${GPU_CHECK_RUN_S:-50}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 TOKENIZERS_PARALLELISM=false

# The package is the folder services/: a link named pipelinerl, on the path of every process
# (tests and the launcher start children with a PYTHONPATH of their own) through a .pth file.
LINKS=$(mktemp -d)
ln -s "$PWD/services" "$LINKS/pipelinerl"
echo "$LINKS" >"$($PYTHON -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/pipelinerl-check.pth"
export PYTHONPATH="$PWD"

summary() { echo "$*" | tee -a "$OUT/summary.txt"; }

# step NAME SECONDS COMMAND...: run it with a limit, log to $OUT/NAME.log, keep its last JSON line.
step() {
  local name=$1 limit=$2
  shift 2
  local started=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary "$name: rc=$rc in $((SECONDS - started)) s"
  grep -E '^\{.*\}$' "$OUT/$name.log" | tail -n 1 | tee -a "$OUT/summary.txt"
  tail -n 3 "$OUT/$name.log"
}

wants() { [[ " $STEPS " == *" $1 "* ]]; }

summary "host: $(nvidia-smi -L 2>&1 | head -n 1); $($PYTHON --version)"
if compgen -G ".gpu-wheels/*.whl" >/dev/null; then
  $PYTHON -m pip install --quiet --no-index --no-deps .gpu-wheels/*.whl 2>&1 | grep -v "^$" | tail -n 3
fi
$PYTHON -c "import torch, pipelinerl.cli; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
  | tee -a "$OUT/summary.txt" || exit 1

if wants tests; then
  step pytest 130 $PYTHON -m pytest tests/gpu -m gpu -q -p no:cacheprovider -o addopts="-ra"
fi
if wants engine; then
  step bench-engine 90 $PYTHON benchmarks/engine.py --device cuda --preset qwen2-0.5b --dtype bfloat16 \
    --requests 16 --batch 8 --max-new 128
fi
if wants weights; then
  # Requests decode from the trainer's first watcher through every update, then to --max-new: on
  # one H200 the trainer packs each version on the host in 1.1 s (0.5B) or 5.3 s (1.5B). The
  # built-in engine decoded 8 rows at about 8 steps/s before its host work per step was cut, and
  # should now decode several times faster: 500 and 700 tokens outlast the updates at either pace
  # and end within the steps' limits at the old one. The first version's swap moves the parameters
  # (first_swap_ms), so 0.5B takes three versions for two steady-state ones.
  step bench-weights-0.5b 120 $PYTHON benchmarks/weight_update.py --device cuda --preset qwen2-0.5b \
    --dtype bfloat16 --updates 3 --max-new 500
  step bench-weights-1.5b 150 $PYTHON benchmarks/weight_update.py --device cuda --preset qwen2-1.5b \
    --dtype bfloat16 --updates 2 --max-new 700
fi
if wants run; then
  RUN_DIR=$(mktemp -d)/run
  step run $((RUN_S + 45)) $PYTHON -c "from pipelinerl.cli import app; app()" run \
    --device "${GPU_CHECK_DEVICE:-cuda}" --model "${GPU_CHECK_MODEL:-gpu-100m}" --run-dir "$RUN_DIR" --duration-s "$RUN_S" --max-samples "${GPU_CHECK_RUN_SAMPLES:-4096}"
  step run-evidence 20 $PYTHON scripts/run_evidence.py "$RUN_DIR"
  cp "$RUN_DIR/metrics.jsonl" "$OUT/run-metrics.jsonl" 2>/dev/null
  cp "$RUN_DIR/plot.png" "$OUT/run-plot.png" 2>/dev/null
fi
summary "done"
