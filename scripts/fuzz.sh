#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, the "fuzz" preset: clang 14, ASan + UBSan)
# and runs each for a while on a copy of its seed corpus.
# docs/architecture.md, "Fuzzing".
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: scripts/fuzz.sh [--time SECONDS] [--jobs N] [--parallel P] [--no-install] [TARGET...]

Configures and builds the "fuzz" preset (build/fuzz), then runs
each TARGET (default: checkpoint program cache_entry c_abi) for SECONDS (default 30),
each with N libFuzzer jobs (default 1), P targets at a time (default 1). The committed
seed corpus (tests/fuzz/corpus/TARGET) is read, never written: new inputs go to
build/fuzz/corpus/TARGET, crashes to build/fuzz/crashes/TARGET, logs to
build/fuzz/logs/TARGET.log.

Prints per target the executions, the edges covered (libFuzzer's cov:) and whether it
crashed. Exits non-zero when a target crashed, failed its oracle or did not run.
Installs clang-14 and libclang-rt-14-dev with apt-get if they are missing (not with
--no-install).
USAGE
}

seconds=30
jobs=1
parallel=1
install=1
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --time) seconds=${2:-}; shift 2 || shift ;;
    --jobs) jobs=${2:-}; shift 2 || shift ;;
    --parallel) parallel=${2:-}; shift 2 || shift ;;
    --no-install) install=0; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(checkpoint program cache_entry c_abi)
for n in "$seconds" "$jobs" "$parallel"; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || { echo "fuzz.sh: '$n' is not a positive integer (--time, --jobs and --parallel take one)" >&2; exit 2; }
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
for t in "${targets[@]}"; do
  [ -f "tests/fuzz/fuzz_$t.cpp" ] ||
    { echo "fuzz.sh: no fuzz target '$t' (tests/fuzz/fuzz_$t.cpp); the targets are checkpoint, program, cache_entry and c_abi" >&2; exit 2; }
done

# ---- clang 14 and its libFuzzer runtime, with what the library needs ----
[ $install -eq 0 ] || bash scripts/install_deps.sh clang-14 libclang-rt-14-dev

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

# run_target TARGET: runs one target; writes its summary line to $out/logs/TARGET.result.
run_target() {
  local t=$1
  local seeds=tests/fuzz/corpus/$t corpus=$out/corpus/$t crashes=$out/crashes/$t log=$out/logs/$t.log
  mkdir -p "$corpus" "$crashes"
  [ -d "$seeds" ] && cp -n "$seeds"/* "$corpus"/ 2>/dev/null || true
  local limits=(-rss_limit_mb=2048)
  [ "$t" = c_abi ] && limits+=(-malloc_limit_mb=2048)
  local fuzz_args=("${limits[@]}" -max_total_time="$seconds" -print_final_stats=1 -artifact_prefix="$root/$crashes/")
  [ "$jobs" -gt 1 ] && fuzz_args+=(-jobs="$jobs" -workers="$jobs")
  local workdir
  workdir=$(mktemp -d)  # with -jobs, libFuzzer writes fuzz-N.log into the working directory
  echo "fuzz.sh: $t for ${seconds}s ($jobs job(s)); log $log"
  local rc=0
  (cd "$workdir" && "$root/build/fuzz/tests/fuzz/fuzz_$t" "${fuzz_args[@]}" "$root/$corpus") >"$log" 2>&1 || rc=$?
  cat "$workdir"/fuzz-*.log >>"$log" 2>/dev/null || true
  rm -rf "$workdir"
  local execs cov verdict
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | awk '{ s += $2 } END { print s + 0 }')
  cov=$(grep -Eo '(#[0-9]+|DONE).*cov: [0-9]+' "$log" | grep -Eo 'cov: [0-9]+' | awk '{ print $2 }' | sort -n | tail -1 || true)
  if [ $rc -eq 0 ]; then
    verdict="no crash"
  else
    verdict="CRASHED (exit $rc; see $log and $crashes)"
  fi
  grep -q "ORACLE FAILED" "$log" && verdict="ORACLE FAILED (see $log and $crashes)"
  printf '%-12s executions %-9s edges %-6s %s\n' "$t" "$execs" "${cov:-?}" "$verdict" >"$out/logs/$t.result"
}

mkdir -p "$out/logs"
for t in "${targets[@]}"; do rm -f "$out/logs/$t.result"; done
running=0
for t in "${targets[@]}"; do
  if [ "$running" -ge "$parallel" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  run_target "$t" &
  running=$((running + 1))
done
wait || true

echo
echo "fuzz.sh: ${seconds}s per target"
failed=0
for t in "${targets[@]}"; do
  if [ -f "$out/logs/$t.result" ]; then
    line=$(cat "$out/logs/$t.result")
  else
    line="$t: did not run (see $out/logs/$t.log)"
  fi
  echo "  $line"
  [[ $line == *"no crash"* ]] || failed=$((failed + 1))
done
echo "fuzz.sh: $((${#targets[@]} - failed)) of ${#targets[@]} targets ran without a crash or an oracle failure; $failed targets failed out of ${#targets[@]}"
[ $failed -eq 0 ]
