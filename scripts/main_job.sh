#!/usr/bin/env bash
# Installs what is missing, builds the Release preset's stepfuse-bench and runs it:
# a fused AdamW step (with clipping) on the GPT-2 124M tensor list, reporting time,
# GB/s, the share of the bandwidth measured in the same process, and the
# fused/unfused ratio. Arguments are passed to stepfuse-bench (try --help).
# Then runs the example stepfuse-train-mlp: a small MLP trained with f16 gradients,
# GradScaler and a fused, clipped AdamW step (a few seconds; exits non-zero if the
# loss does not fall).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

jobs=${STEPFUSE_JOBS:-$(nproc 2>/dev/null || echo 2)}
bash scripts/install_deps.sh
cmake --preset release --log-level=WARNING
cmake --build --preset release --parallel "$jobs" --target stepfuse-bench stepfuse-train-mlp
build/release/bench/stepfuse-bench "$@"
# --help, --version and --print-shapes ask stepfuse-bench a question, not for a training run;
# --json-only wants stdout to hold the JSON alone.
for arg in "$@"; do
  case $arg in -h | --help | --version | --print-shapes | --json-only) exit 0 ;; esac
done
echo
exec build/release/examples/stepfuse-train-mlp
