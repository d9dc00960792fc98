#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, the "fuzz" preset: clang 14, ASan + UBSan)
# and runs each for a while on a copy of its seed corpus. docs/architecture.md, "Fuzzing".
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/fuzz.sh [--time SECONDS] [--jobs N] [TARGET...]

Configures and builds the "fuzz" preset (build/fuzz), then runs each TARGET (default:
checkpoint program cache_entry c_abi) for SECONDS (default 30) with N parallel jobs
(default 1). The committed seed corpus (tests/fuzz/corpus/TARGET) is read, never
written: new inputs go to build/fuzz/corpus/TARGET, crashes to build/fuzz/crashes/TARGET,
logs to build/fuzz/logs/TARGET.log.

Prints per target the executions, the edges covered (libFuzzer's cov:) and whether it
crashed. Exits non-zero when a target crashed, failed its oracle or did not run.
Installs clang-14 and libclang-rt-14-dev with apt-get if they are missing.
EOF
}

seconds=30
jobs=1
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --time) seconds=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(checkpoint program cache_entry c_abi)

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

# ---- clang 14 and its libFuzzer runtime, with what the library needs ----
bash scripts/install_deps.sh clang-14 libclang-rt-14-dev

# ---- build ----
cmake --preset fuzz --log-level=WARNING
fuzz_targets=()
for t in "${targets[@]}"; do fuzz_targets+=("fuzz_$t"); done
cmake --build --preset fuzz --parallel "$(nproc 2>/dev/null || echo 2)" --target "${fuzz_targets[@]}"

# ---- run ----
out=build/fuzz
export ASAN_OPTIONS="abort_on_error=1:detect_leaks=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export STEPFUSE_CACHE_DIR=off  # the process-wide kernel cache in memory only
failed=0
summary=()
for t in "${targets[@]}"; do
  seeds=tests/fuzz/corpus/$t
  corpus=$out/corpus/$t
  crashes=$out/crashes/$t
  log=$out/logs/$t.log
  mkdir -p "$corpus" "$crashes" "$(dirname "$log")"
  [ -d "$seeds" ] && cp -n "$seeds"/* "$corpus"/ 2>/dev/null || true
  limits=(-rss_limit_mb=2048)
  [ "$t" = c_abi ] && limits+=(-malloc_limit_mb=2048)
  echo "fuzz.sh: $t for ${seconds}s ($jobs job(s)); log $log"
  set +e
  if [ "$jobs" -gt 1 ]; then
    "$out/tests/fuzz/fuzz_$t" "${limits[@]}" -max_total_time="$seconds" -print_final_stats=1 \
      -artifact_prefix="$crashes/" -jobs="$jobs" -workers="$jobs" "$corpus" >"$log" 2>&1
  else
    "$out/tests/fuzz/fuzz_$t" "${limits[@]}" -max_total_time="$seconds" -print_final_stats=1 \
      -artifact_prefix="$crashes/" "$corpus" >"$log" 2>&1
  fi
  rc=$?
  set -e
  # With -jobs, each worker logs to fuzz-N.log in the working directory.
  [ "$jobs" -gt 1 ] && cat fuzz-*.log >>"$log" 2>/dev/null && rm -f fuzz-*.log
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | awk '{ s += $2 } END { print s + 0 }')
  cov=$(grep -Eo '(#[0-9]+|DONE).*cov: [0-9]+' "$log" | grep -Eo 'cov: [0-9]+' | awk '{ print $2 }' | sort -n | tail -1)
  if [ $rc -eq 0 ]; then
    verdict="no crash"
  else
    verdict="CRASHED (exit $rc; see $log and $crashes)"
    failed=1
  fi
  grep -q "ORACLE FAILED" "$log" && verdict="ORACLE FAILED (see $log and $crashes)" && failed=1
  summary+=("$(printf '%-12s executions %-9s edges %-6s %s' "$t" "$execs" "${cov:-?}" "$verdict")")
done

echo
echo "fuzz.sh: ${seconds}s per target"
printf '  %s\n' "${summary[@]}"
exit $failed
