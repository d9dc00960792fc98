#!/usr/bin/env bash
# Builds the Python package and runs its tests (python/tests: the extension's bindings and
# stepfuse.torch against PyTorch's own optimizers and GradScaler).
#
#   scripts/test_python.sh [--no-install] [--no-build] [PYTEST_ARG...]
#
# Installs what is missing (scripts/install_deps.sh: the compiler, CMake, the library's
# dependencies and python3-venv; not with --no-install), makes the virtual environment
# build/pyvenv once (or $STEPFUSE_PYVENV) and reuses it, puts into it from PyPI whatever
# of torch, numpy, pytest and the build requirements (scikit-build-core, nanobind; CMake
# and Ninja too when the system's are missing or CMake is older than 3.20) it lacks, then
# `pip install --no-build-isolation .` (incremental: the build folder build/python/ is kept;
# not with --no-build, which tests the package as installed), then
# `python -m pytest python/tests -q PYTEST_ARG...`.
#
# Ends with pytest's summary and one line "python: N tests failed out of T (S skipped)"
# (T counts the tests that ran). Exits with pytest's status, or 1 when the package does not
# build. pip honours its own settings (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, ...), e.g. to take
# torch's CPU-only wheels from PyTorch's index. STEPFUSE_JOBS sets the build's parallelism.
#
# Without network the environment may not be made: then the Python tests are skipped with a
# message and the script exits 0, except under CI=true, where that is a failure (exit 1).
# Under CI=true pip shows no progress bars and pytest writes no .pytest_cache.
set -uo pipefail

usage() { sed -n '2,/^set -uo pipefail$/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

install=1
build=1
pytest_args=()
while (($#)); do
  case $1 in
    --no-install) install=0 ;;
    --no-build) build=0 ;;
    -h | --help) usage; exit 0 ;;
    *) pytest_args+=("$1") ;;
  esac
  shift
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=${STEPFUSE_PYVENV:-$root/build/pyvenv}
ci=0
[ "${CI:-}" = true ] && ci=1
pip_opts=(--disable-pip-version-check)
pytest_opts=(-q)
if [ $ci -eq 1 ]; then
  pip_opts+=(--progress-bar off)
  pytest_opts+=(-p no:cacheprovider)
fi

# unavailable MESSAGE: the environment cannot be made; a skip here, a failure under CI.
unavailable() {
  if [ $ci -eq 1 ]; then
    echo "test_python: $1 (CI=true: failing)" >&2
    exit 1
  fi
  echo "test_python: $1; the Python tests are skipped" >&2
  echo "python: 0 tests failed out of 0 (not run)"
  exit 0
}

# ---- the system's packages ----
if [ $install -eq 1 ]; then
  bash scripts/install_deps.sh || { echo "test_python: cannot install the dependencies" >&2; exit 1; }
fi

# ---- the virtual environment ----
if [ ! -x "$venv/bin/python" ]; then
  command -v python3 >/dev/null 2>&1 || unavailable "no python3"
  echo "test_python: making the virtual environment $venv"
  python3 -m venv "$venv" || unavailable "python3 -m venv $venv failed (Debian: apt-get install python3-venv)"
fi
py=$venv/bin/python

# The requirements the environment lacks (or has too old), one pip requirement a line.
missing=$("$py" - <<'PY'
import importlib.metadata as md
import re
import shutil
import subprocess

def version(dist):
    try:
        return tuple(int(x) for x in re.findall(r"\d+", md.version(dist))[:2])
    except md.PackageNotFoundError:
        return None

need = {"torch": None, "numpy": None, "pytest": None,
        "scikit-build-core": (0, 10), "nanobind": (2, 2)}
for dist, least in need.items():
    have = version(dist)
    if have is None or (least is not None and have < least):
        print(dist if least is None else f"{dist}>={least[0]}.{least[1]}")

# CMake >= 3.20 and Ninja for the build: the system's if good enough, else from PyPI.
cmake = None
if shutil.which("cmake"):
    out = subprocess.run(["cmake", "--version"], capture_output=True, text=True).stdout
    m = re.search(r"(\d+)\.(\d+)", out)
    cmake = (int(m[1]), int(m[2])) if m else None
if (cmake is None or cmake < (3, 20)) and (version("cmake") or (0, 0)) < (3, 20):
    print("cmake>=3.20")
if not shutil.which("ninja") and version("ninja") is None:
    print("ninja")
PY
) || unavailable "$py does not run"
if [ -n "$missing" ]; then
  mapfile -t reqs <<<"$missing"
  echo "test_python: installing ${reqs[*]} into $venv"
  "$py" -m pip install "${pip_opts[@]}" -q "${reqs[@]}" || unavailable "pip could not install ${reqs[*]}"
fi

# ---- the package ----
if [ $build -eq 1 ]; then
  echo "test_python: pip install --no-build-isolation . (build folder build/python/)"
  export CMAKE_BUILD_PARALLEL_LEVEL=${STEPFUSE_JOBS:-$(nproc 2>/dev/null || echo 2)}
  if ! "$py" -m pip install "${pip_opts[@]}" --no-build-isolation "$root"; then
    echo "test_python: the package does not build" >&2
    echo "python: 1 tests failed out of 1 (the package did not build)"
    exit 1
  fi
fi

# ---- the tests ----
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$py" -m pytest python/tests "${pytest_opts[@]}" "${pytest_args[@]}" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}

# pytest's summary: "3 failed, 120 passed, 12 skipped, 1 error in 41.20s"
summary=$(grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s' "$log" | tail -n 1)
count() { grep -oE "[0-9]+ $1" <<<"$summary" | grep -oE '^[0-9]+' || echo 0; }
passed=$(count passed)
failed=$(($(count failed) + $(count 'errors?')))
skipped=$(count skipped)
ran=$((passed + failed + $(count xfailed) + $(count xpassed)))
if [ $rc -ne 0 ] && [ $failed -eq 0 ]; then
  failed=1  # pytest failed without a count (interrupted, a usage error, nothing collected)
  ran=$((ran + 1))
fi
echo "python: ${failed} tests failed out of ${ran} (${skipped} skipped)"
exit "$rc"
