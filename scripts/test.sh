#!/usr/bin/env bash
# Installs what is missing, then builds and runs every test twice: a Release build
# (preset "release") and an AddressSanitizer + UndefinedBehaviorSanitizer build
# (preset "asan"). Prints CTest's summaries and each phase's time; exits non-zero if
# anything failed. Extra arguments go to both ctest runs (e.g. -L consumer, -R adam).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

jobs=${STEPFUSE_JOBS:-$(nproc 2>/dev/null || echo 2)}
failed=()
summary=()

# phase NAME COMMAND...: runs one phase, records its time and whether it failed.
phase() {
  local name=$1; shift
  local start=$SECONDS
  echo "==> ${name}: $*"
  "$@"
  local rc=$?
  local took=$((SECONDS - start))
  if [ $rc -eq 0 ]; then
    summary+=("$(printf '%-22s %5ds  ok' "$name" "$took")")
  else
    summary+=("$(printf '%-22s %5ds  FAILED (exit %d)' "$name" "$took" "$rc")")
    failed+=("$name")
  fi
  return $rc
}

phase "install deps" bash scripts/install_deps.sh || { echo "test.sh: cannot install the dependencies" >&2; exit 1; }

# ctest_counted PRESET ARGS...: runs ctest and adds its pass/fail counts to the totals.
passed=0
failed_tests=0
ctest_counted() {
  local preset=$1; shift
  local log
  log=$(mktemp)
  ctest --preset "$preset" --parallel "$jobs" "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  # "100% tests passed, 0 tests failed out of 756"
  local line
  line=$(grep -E 'tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -n 1)
  if [ -n "$line" ]; then
    local nfail ntotal
    nfail=$(echo "$line" | sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/')
    ntotal=$(echo "$line" | sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\2/')
    passed=$((passed + ntotal - nfail))
    failed_tests=$((failed_tests + nfail))
  fi
  rm -f "$log"
  return "$rc"
}

for preset in release asan; do
  phase "${preset}: configure" cmake --preset "$preset" --log-level=WARNING &&
  phase "${preset}: build" cmake --build --preset "$preset" --parallel "$jobs" &&
  phase "${preset}: test" ctest_counted "$preset" "$@"
done

echo
echo "==> phases"
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -ne 0 ]; then
  echo "test.sh: FAILED: ${failed[*]}"
  echo "${passed} passed, $((failed_tests > 0 ? failed_tests : 1)) failed"
  exit 1
fi
echo "test.sh: all passed (Release and ASan/UBSan)"
echo "${passed} passed, ${failed_tests} failed"
