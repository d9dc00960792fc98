#!/usr/bin/env bash
# Times stepfuse's fused optimizer step beside PyTorch (eager fused/foreach AdamW with
# GradScaler, torch.compile) and JAX/optax, in one process: bench/peers/peers.py.
#
# Creates (once) a virtual environment with torch, numpy, jax, optax and jmp from PyPI
# (build/peers-venv, or $STEPFUSE_PEERS_VENV: an existing venv that already has them is
# used as it is), builds stepfuse-bench and the ctypes shim with the release preset (in
# build/release, or $STEPFUSE_PEERS_BUILD_DIR), and runs peers.py with the arguments given
# here (try --help). Not part of CI: the first run
# downloads several GB of wheels (PyPI's torch brings its CUDA libraries; the venv is about
# 6 GB), and a gpt2-124m run needs about 10 GB of memory.
#
#   bash bench/peers/run.sh                                # gpt2-124m, 2 threads, all peers
#   bash bench/peers/run.sh --overhead                     # per-step fixed cost on many-small
#   bash bench/peers/run.sh --preset llama7b-layer --json peers.json
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

# --help: peers.py's usage needs neither the build nor the packages.
for arg in "$@"; do
  if [[ $arg == --help || $arg == -h ]]; then exec "${PYTHON:-python3}" bench/peers/peers.py --help; fi
done

venv=${STEPFUSE_PEERS_VENV:-build/peers-venv}
py=$venv/bin/python
if ! "$py" -c "import torch, numpy, jax, optax" >/dev/null 2>&1; then
  echo "run.sh: setting up $venv (torch, numpy, jax, optax, jmp from PyPI; once)"
  [[ -x $py ]] || "${PYTHON:-python3}" -m venv "$venv"
  "$py" -m pip install --quiet --upgrade pip
  "$py" -m pip install --quiet torch numpy jax optax
fi
# jmp (DeepMind's loss-scaling library for JAX) is optional: without it the JAX peer uses
# an inline copy of the three functions it needs.
"$py" -c "import jmp" >/dev/null 2>&1 || "$py" -m pip install --quiet jmp ||
  echo "run.sh: jmp not installable; the JAX peer uses its inline equivalent"

jobs=${STEPFUSE_JOBS:-$(nproc 2>/dev/null || echo 2)}
build=${STEPFUSE_PEERS_BUILD_DIR:-build/release}
bash scripts/install_deps.sh
cmake --preset release -B "$build" --log-level=WARNING
cmake --build "$build" --parallel "$jobs" --target stepfuse-bench stepfuse_peer_shim
exec "$py" bench/peers/peers.py --build-dir "$build" "$@"
