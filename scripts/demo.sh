#!/usr/bin/env bash
# Install catalog-es into .venv and run the main job on the embedded default
# (a SQLite file): load the example catalog.yaml, add, scale and list models,
# read the past, roll back. Runs in a scratch folder; the repo is untouched.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"

if [ ! -x "$here/.venv/bin/catalog-es" ]; then
  python3 -m venv "$here/.venv"
  "$here/.venv/bin/python" -m pip install --quiet --upgrade pip
  "$here/.venv/bin/python" -m pip install --quiet -e "$here"
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
cp "$here/catalog.yaml" .
# Its own log and config, whatever the shell's environment names.
export CATALOG_ES_DB="sqlite:///$work/catalog.db" CATALOG_ES_CONFIG="$work/catalog.yaml"
export CATALOG_ES_ACTOR=demo
# Each command is shown as it can be typed again, its arguments quoted.
ces() { printf '$ catalog-es%s\n' "$(printf ' %q' "$@")" >&2; "$here/.venv/bin/catalog-es" "$@"; echo >&2; }

cat > qwen.yaml <<'EOF'
name: qwen2.5-7b-instruct
engine: vllm
source: hf://Qwen/Qwen2.5-7B-Instruct
profiles:
  - {name: l4, gpus: 1, gpu_memory_gb: 24, min_memory_gb: 32, cpu_cores: 4}
scaling: {min: 0, max: 2}
owner: team:search
fallbacks: [llama-3.1-8b-instruct]
EOF

ces model list
ces model add qwen.yaml --reason "trying Qwen for search"
ces model scale qwen2.5-7b-instruct --min 1 --max 4 --by alice
ces model class qwen2.5-7b-instruct critical --by bob
# Refused: declared models are changed in catalog.yaml, not at runtime (exit 1).
ces model scale llama-3.1-8b-instruct --max 20 || true
ces log
ces model show qwen2.5-7b-instruct --at 2
ces diff 2
ces rollback --to 2 --dry-run
ces rollback --to 2 --by alice --reason "scale-up was premature"
ces model list
