#!/usr/bin/env bash
# Installs what building and testing stepfuse needs, from Debian's packages (Debian 12).
# Idempotent: installs only what is missing, and runs `apt-get update` only then.
# Works as root, or through sudo when it is available. Arguments name more packages.
set -euo pipefail

packages=(
  build-essential     # g++, make
  cmake               # >= 3.23 for CMakePresets.json
  ninja-build         # the presets' generator
  pkg-config          # the consumer test checks stepfuse.pc
  libhwy-dev          # Highway SIMD with dynamic dispatch (the CPU backend)
  libgtest-dev libgmock-dev
  libbenchmark-dev    # Google Benchmark (bench/)
  libcli11-dev        # command lines (stepfuse-bench, the examples)
  nlohmann-json3-dev  # JSON (the kernel ABI descriptions, benchmark reports)
  libxxhash-dev       # cache keys and checksums
  llvm-14-dev         # the LLVM CPU backend (optional: without it the build has Highway alone)
  libopenmpi-dev openmpi-bin  # stepfuse::mpi and its mpirun tests (optional: without them, neither)
  python3-venv        # build/pyvenv below
  python3-dev         # Python's headers: the extension module (pip install .)
)
# Arguments: more Debian packages to install the same way (scripts/fuzz.sh: clang 14).
packages+=("$@")

# The safetensors Python package (and NumPy) in a virtual environment under build/,
# made once and reused: safetensors_test opens a checkpoint with it. Best effort: without
# it (no network, say) that one test is skipped, nothing fails.
python_venv() {
  local root venv
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  venv="$root/build/pyvenv"
  if "$venv/bin/python3" -c "import safetensors.numpy, numpy" >/dev/null 2>&1; then
    return 0
  fi
  if command -v python3 >/dev/null 2>&1 && python3 -m venv "$venv" >/dev/null 2>&1 &&
     "$venv/bin/python3" -m pip install -q --disable-pip-version-check safetensors numpy >/dev/null 2>&1; then
    echo "install_deps: safetensors and numpy in $venv"
  else
    echo "install_deps: could not put safetensors into $venv; the safetensors interoperability test will be skipped" >&2
  fi
  return 0
}

if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_deps: no dpkg/apt-get here; install these (or their equivalents) yourself:" >&2
  echo "  ${packages[*]}" >&2
  python_venv
  exit 0
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages present"
  python_venv
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1; then
  sudo=(sudo)
else
  echo "install_deps: missing ${missing[*]}, and not root and no sudo to install them" >&2
  exit 1
fi

echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! { "${sudo[@]}" apt-get update -qq &&
       "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "install_deps: apt-get failed" >&2
  exit 1
fi
echo "install_deps: done"
python_venv
