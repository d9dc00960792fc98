#!/usr/bin/env bash
# Installs what is missing, then builds and runs the tests in four builds: Release
# (preset "release", every test), AddressSanitizer + UndefinedBehaviorSanitizer (preset
# "asan", every test), the libFuzzer targets (preset "fuzz", clang 14: each for a short
# fixed time on its seed corpus) and ThreadSanitizer (preset "tsan": the multi-threaded
# suites), then the Python package with its tests (scripts/test_python.sh: pip install
# into build/pyvenv, pytest). Prints CTest's and pytest's summaries and each phase's time;
# exits non-zero if anything failed. Extra arguments go to every ctest run (e.g. -L
# consumer, -R adam).
# A CTest test that fails runs once more (ctest --repeat until-pass:2): the summary at the
# end names every test that failed an attempt, with the tail of that attempt's output, and
# says which of them passed on the rerun (flaky) and which failed twice (a failure).
# STEPFUSE_FUZZ_SECONDS sets the fuzzing time per target (default 30; 0 skips it).
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

phase "install deps" bash scripts/install_deps.sh clang-14 libclang-rt-14-dev || { echo "test.sh: cannot install the dependencies" >&2; exit 1; }

# counted COMMAND...: runs COMMAND, shows its output and adds the counts of its summary
# line to the totals: ctest's "100% tests passed, 0 tests failed out of 756",
# scripts/fuzz.sh's "...; 0 targets failed out of 4", or scripts/test_python.sh's
# "python: 0 tests failed out of 353 (12 skipped)".
passed=0
failed_tests=0
counted() {
  local log
  log=$(mktemp)
  "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  local counts
  counts=$(sed -nE 's/.* ([0-9]+) (tests?|targets) failed out of ([0-9]+).*/\1 \3/p' "$log" | tail -n 1)
  if [ -n "$counts" ]; then
    local nfail ntotal
    read -r nfail ntotal <<<"$counts"
    passed=$((passed + ntotal - nfail))
    failed_tests=$((failed_tests + nfail))
  fi
  rm -f "$log"
  return "$rc"
}

# failed_attempts PRESET: every attempt of a test that failed in that build's last ctest
# run, from CTest's LastTest.log: "PRESET: NAME" and the last 30 lines of its output (the
# first 20 such attempts).
attempts=()
failed_attempts() {
  local log="build/$1/Testing/Temporary/LastTest.log"
  [ -f "$log" ] || return 0
  awk -v preset="$1" '
    /^[0-9]+\/[0-9]+ Testing: / { name = $0; sub(/^[0-9]+\/[0-9]+ Testing: /, "", name); n = 0; inout = 0; next }
    /^Output:$/ { inout = 1; getline; next }
    /^<end of output>$/ { inout = 0; next }
    inout { lines[n++ % 30] = $0; next }
    /^Test Failed\.$/ && ++k > 20 { next }
    /^Test Failed\.$/ {
      printf "--- %s: %s failed; the last lines of its output:\n", preset, name
      for (i = (n > 30 ? n - 30 : 0); i < n; ++i) print "    " lines[i % 30]
    }
    END { if (k > 20) printf "--- %s: %d more failed attempts (build/%s/Testing/Temporary/LastTest.log)\n", preset, k - 20, preset }' "$log"
}

fuzz_seconds=${STEPFUSE_FUZZ_SECONDS:-30}
for preset in release asan fuzz tsan; do
  [ "$preset" = fuzz ] && [ "$fuzz_seconds" = 0 ] && continue
  phase "${preset}: configure" cmake --preset "$preset" --log-level=WARNING &&
    phase "${preset}: build" cmake --build --preset "$preset" --parallel "$jobs" || continue
  if [ "$preset" = fuzz ]; then
    # each fuzz target on its seed corpus, $jobs at a time
    phase "fuzz: ${fuzz_seconds}s per target" counted bash scripts/fuzz.sh --no-install --time "$fuzz_seconds" --parallel "$jobs"
  else
    rm -f "build/${preset}/Testing/Temporary/LastTest.log"
    phase "${preset}: test" counted ctest --preset "$preset" --parallel "$jobs" --repeat until-pass:2 "$@"
    attempts+=("$(failed_attempts "$preset")")
  fi
done

# the Python package (built by pip, not by the presets) and its pytest suite
phase "python: build + test" counted bash scripts/test_python.sh --no-install

report=$(printf '%s' "${attempts[@]}")
if [ -n "$report" ]; then
  echo
  echo "==> tests that failed an attempt (each ran twice at most; one that passed on the"
  echo "    rerun is flaky, one that failed twice is in CTest's FAILED list above)"
  printf '%s\n' "${attempts[@]}" | sed '/^$/d'
fi

echo
echo "==> phases"
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -ne 0 ]; then
  echo "test.sh: FAILED: ${failed[*]}"
  echo "${passed} passed, $((failed_tests > 0 ? failed_tests : 1)) failed"
  exit 1
fi
echo "test.sh: all passed (Release, ASan/UBSan with fuzzing, TSan, Python)"
echo "${passed} passed, ${failed_tests} failed"
