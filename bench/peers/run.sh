#!/usr/bin/env bash
# Times stepfuse's fused optimizer step beside PyTorch (eager fused/foreach AdamW with
# GradScaler, torch.compile) and JAX/optax, in one process: bench/peers/peers.py. stepfuse
# is timed through its Python package: the C++ API's binding and stepfuse.torch. With
# --dtype bf16, the low-precision peers instead: bf16 weights and gradients, stepfuse.torch
# with fp32 masters, stochastic rounding and compensated weights, and with its state stored
# compressed (stochastic rounding with q8 or bf16 state, masters with q8 state), beside
# torchao's AdamW (bf16_stochastic_round) and AdamW8bit and bitsandbytes' AdamW8bit on the CPU.
#
# Creates (once) a virtual environment with torch, numpy, jax, optax and jmp from PyPI
# (build/peers-venv, or $STEPFUSE_PEERS_VENV: an existing venv that already has them is
# used as it is), adds torchao and bitsandbytes to it once (optional: a peer whose package
# could not be installed is skipped, saying so), installs the stepfuse package from this checkout into it (pip install .,
# incremental: it builds in build/python/; in a $STEPFUSE_PEERS_VENV that already has
# stepfuse, only if STEPFUSE_PEERS_INSTALL=1), builds stepfuse-bench (the tensor lists)
# with the release preset (in build/release, or $STEPFUSE_PEERS_BUILD_DIR), and runs
# peers.py with the arguments given here (try --help). STEPFUSE_PEERS_NO_BUILD=1 skips the
# install and the build and uses what is there. Not part of CI: the first run downloads
# several GB of wheels (PyPI's torch brings its CUDA libraries; the venv is about 6 GB), and
# a gpt2-124m run with every peer peaks at about 17 GB of memory.
#
#   bash bench/peers/run.sh                                # gpt2-124m, 2 threads, all peers
#   bash bench/peers/run.sh --overhead                     # per-step fixed cost on many-small
#   bash bench/peers/run.sh --preset llama7b-layer --json peers.json
#   bash bench/peers/run.sh --dtype bf16                   # the low-precision peers, gpt2-124m
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
# torchao and bitsandbytes (the --dtype bf16 peers) are optional too: without them those
# peers are skipped with the reason. Looked up without importing (importing either loads torch).
have() { "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" >/dev/null 2>&1; }
have torchao || "$py" -m pip install --quiet torchao ||
  echo "run.sh: torchao not installable; the torchao peers of --dtype bf16 are skipped"
have bitsandbytes || "$py" -m pip install --quiet bitsandbytes ||
  echo "run.sh: bitsandbytes not installable; the bnb-adamw8bit peer of --dtype bf16 is skipped"

build=${STEPFUSE_PEERS_BUILD_DIR:-build/release}
if [[ ${STEPFUSE_PEERS_NO_BUILD:-0} != 1 ]]; then
  jobs=${STEPFUSE_JOBS:-$(nproc 2>/dev/null || echo 2)}
  bash scripts/install_deps.sh
  # The package builds the library itself (scikit-build-core; CMake and a C++20 compiler,
  # as for the release preset). Installed into the venv this script made on every run, so
  # that what is timed is this checkout.
  if [[ -z ${STEPFUSE_PEERS_VENV:-} || ${STEPFUSE_PEERS_INSTALL:-0} == 1 ]] ||
     ! "$py" -c "import stepfuse.torch" >/dev/null 2>&1; then
    echo "run.sh: pip install . into $venv (the stepfuse package: the library and its binding)"
    CMAKE_BUILD_PARALLEL_LEVEL=$jobs "$py" -m pip install --quiet .
  fi
  cmake --preset release -B "$build" --log-level=WARNING
  cmake --build "$build" --parallel "$jobs" --target stepfuse-bench
fi
exec "$py" bench/peers/peers.py --build-dir "$build" "$@"
