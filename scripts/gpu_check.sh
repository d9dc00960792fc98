#!/usr/bin/env bash
# Builds and runs everything GPU-related on a machine with an NVIDIA GPU but without the
# project's development packages, in a few minutes, and prints a short table.
#
#   scripts/gpu_check.sh --prepare
#       Here, on a Debian 12 machine with the dependencies (scripts/install_deps.sh): copies
#       the headers, libraries and CMake package files of Highway, GoogleTest/GMock, Google
#       Benchmark, xxHash, CLI11 and nlohmann-json into .gpu-deps/ (about 15 MiB; ignored
#       by git), rewrites the absolute paths in the package files, and checks that CMake
#       finds every package there, with the system's own hidden, and that a program using
#       them all builds and runs.
#
#   scripts/gpu_check.sh [--no-gpu-ok] [--build-dir DIR] [--jobs N] [--skip-torch]
#       There, from the repository root, with .gpu-deps/ carried along: configures a Release
#       build in DIR (default build-gpu) against .gpu-deps, builds the library, the GPU tests
#       (cuda_gpu_test, cuda_loader_test, cuda_codegen_test, kernel_cache_test,
#       nccl_communicator_test: NCCL's one-rank collectives and a one-rank sharded CUDA
#       optimizer's step, bitwise against the local step, on the GPU) and
#       stepfuse-bench on every core, prints the GPU (nvidia-smi), runs the tests and
#       stepfuse-bench's smoke tests, then stepfuse-bench --backend cuda on gpt2-124m and
#       llama7b-layer (AdamW, clipping to 1.0, bf16 weights and gradients, fp32 masters) and,
#       when torch sees the GPU, PyTorch's step on the same tensor lists
#       (bench/peers/torch_cuda_step.py), gpt2-124m again with the optimizer state stored as
#       bf16 and as q8 (--state), and prints the table: ms per step, GB/s for the
#       bytes the step must move, the device-to-device copy's GB/s measured in the same run
#       and the ratio, kernel launches per step, torch's ms per step and the speedup; and the
#       kernel cache's cold-compile, disk-hit and memory-hit times; when torch sees the GPU,
#       also builds the Python package (build requirements from .gpu-deps/wheels) and runs
#       python/tests/test_torch_cuda.py. Logs, JSON reports and
#       the table go to DIR/gpu_check/, or to $OUT/gpu_check/ when OUT is set.
#       --no-gpu-ok: where no GPU is usable, still exit 0 (the tests skip, the CUDA
#       benchmark reports why it cannot run). --skip-torch: no PyTorch baseline.
#
# Exit codes: 0 everything ran and passed; 1 something failed (build, a test, a benchmark);
# 2 bad arguments or no .gpu-deps; 3 no usable GPU (the GPU tests skipped, the CUDA benchmark
# could not run), unless --no-gpu-ok.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

deps=.gpu-deps
build="build-gpu"
jobs=$(nproc 2>/dev/null || echo 2)
prepare=0
no_gpu_ok=0
skip_torch=0
presets=(gpt2-124m llama7b-layer)
bench_args=(--optimizer adamw --weights bf16 --grads bf16 --clip 1.0 --loss-scale 1024 --steps 50 --warmup 10)

usage() { sed -n '2,/^set -euo pipefail$/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
die() {
  echo "gpu_check: $*" >&2
  exit 2
}

while (($#)); do
  case $1 in
    --prepare) prepare=1 ;;
    --no-gpu-ok) no_gpu_ok=1 ;;
    --skip-torch) skip_torch=1 ;;
    --build-dir) (($# > 1)) || die "--build-dir needs a directory"; build=$2; shift ;;
    --jobs)
      if (($# < 2)) || ! [[ $2 =~ ^[0-9]+$ ]]; then die "--jobs needs a number"; fi
      jobs=$2
      shift
      ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$1' (try --help)" ;;
  esac
  shift
done

# The CMake arguments that point every find_package / find_path at the copy in $1 (an
# absolute path), with CMake's system prefixes hidden, so nothing else is picked up.
dep_cmake_args() {
  local d=$1 arch
  arch=$(find "$d/lib" -mindepth 1 -maxdepth 1 -type d -printf '%f\n' | head -n 1)
  printf '%s\n' "-DCMAKE_PREFIX_PATH=$d" "-DCMAKE_FIND_USE_CMAKE_SYSTEM_PATH=OFF" \
    "-Dhwy_DIR=$d/lib/$arch/cmake/hwy" "-DGTest_DIR=$d/lib/$arch/cmake/GTest" \
    "-Dbenchmark_DIR=$d/lib/$arch/cmake/benchmark" "-DCLI11_DIR=$d/share/cmake/CLI11" \
    "-Dnlohmann_json_DIR=$d/share/cmake/nlohmann_json" "-DXXHASH_INCLUDE_DIR=$d/include"
}

# ---- --prepare: here ------------------------------------------------------------------------
prepare_deps() {
  command -v dpkg-query >/dev/null 2>&1 || die "--prepare copies Debian's packages: run it on a Debian machine with them (scripts/install_deps.sh)"
  local arch lib
  arch=$(gcc -print-multiarch 2>/dev/null || true)
  [[ -n $arch ]] || arch=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
  lib=/usr/lib/$arch
  local need=(/usr/include/hwy "$lib/cmake/hwy" /usr/include/gtest /usr/include/gmock "$lib/cmake/GTest"
    /usr/include/benchmark "$lib/cmake/benchmark" /usr/include/xxhash.h "$lib/libxxhash.a" /usr/include/CLI
    /usr/share/cmake/CLI11 /usr/include/nlohmann /usr/share/cmake/nlohmann_json)
  local missing=() p
  for p in "${need[@]}"; do [[ -e $p ]] || missing+=("$p"); done
  ((${#missing[@]} == 0)) || die "missing ${missing[*]} (run scripts/install_deps.sh first)"

  echo "gpu_check --prepare: copying the dependencies into $deps/"
  rm -rf "$deps"
  mkdir -p "$deps/include" "$deps/lib/$arch/cmake" "$deps/share/cmake"
  # -L: symbolic links become plain files, so the tree travels as it is.
  cp -RL /usr/include/hwy /usr/include/gtest /usr/include/gmock /usr/include/benchmark /usr/include/CLI \
    /usr/include/nlohmann /usr/include/xxhash.h "$deps/include/"
  [[ -e /usr/include/xxh3.h ]] && cp -L /usr/include/xxh3.h "$deps/include/"
  cp -L "$lib"/libhwy*.so* "$lib"/libgtest*.a "$lib"/libgmock*.a "$lib"/libbenchmark*.so* "$lib"/libbenchmark*.a \
    "$lib/libxxhash.a" "$deps/lib/$arch/"
  cp -RL "$lib/cmake/hwy" "$lib/cmake/GTest" "$lib/cmake/benchmark" "$deps/lib/$arch/cmake/"
  cp -RL /usr/share/cmake/CLI11 /usr/share/cmake/nlohmann_json "$deps/share/cmake/"

  # The package files find their prefix relative to their own location, except for a
  # guard against /lib -> /usr/lib links that names the original directory: turn it off
  # (a copy is never the original), and with it the last absolute paths.
  local f
  while IFS= read -r f; do
    # shellcheck disable=SC2016  # ${...} is CMake's, not the shell's
    sed -i -E \
      -e 's|get_filename_component\(_realOrig "/[^"]*" REALPATH\)|set(_realOrig "")  # gpu_check --prepare: a relocated copy|' \
      -e 's|set\(_IMPORT_PREFIX "/[^"]*"\)|set(_IMPORT_PREFIX "${_IMPORT_PREFIX}")|' \
      -e 's|set\(PACKAGE_PREFIX_DIR "/[^"]*"\)|set(PACKAGE_PREFIX_DIR "${PACKAGE_PREFIX_DIR}")|' "$f"
  done < <(find "$deps" -name '*.cmake')
  if grep -rnE '^[^#]*"/(usr|opt|lib|lib64|home|root)' --include='*.cmake' "$deps"; then
    die "absolute paths are left in the package files above"
  fi
  {
    echo "# What .gpu-deps holds (scripts/gpu_check.sh --prepare, $(date -u +%Y-%m-%d))"
    dpkg-query -W -f='${Package} ${Version}\n' libhwy-dev libgtest-dev libgmock-dev libbenchmark-dev libxxhash-dev \
      libcli11-dev nlohmann-json3-dev
    echo "built with: $(g++ --version | head -n 1); $(ldd --version | head -n 1)"
  } >"$deps/MANIFEST"

  # Check: CMake finds each package in the copy alone, every imported file lies inside it,
  # and a program using all of them (as the project does) builds and runs.
  local abs
  abs=$(cd "$deps" && pwd)
  probe=$(mktemp -d)  # global: the exit trap removes it
  trap 'rm -rf "$probe"' EXIT
  cat >"$probe/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.20)
project(gpu_deps_probe LANGUAGES CXX)
set(CMAKE_CXX_STANDARD 20)
find_package(Threads REQUIRED)
find_package(hwy CONFIG REQUIRED)            # as the project's CMake files ask for each
find_package(GTest REQUIRED)
find_package(benchmark REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_path(XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
message(STATUS "gpu-deps-file: ${XXHASH_INCLUDE_DIR}")
foreach(t hwy::hwy GTest::gtest GTest::gtest_main GTest::gmock benchmark::benchmark benchmark::benchmark_main
          CLI11::CLI11 nlohmann_json::nlohmann_json)
  foreach(p IMPORTED_LOCATION_NONE IMPORTED_LOCATION_RELEASE IMPORTED_LOCATION INTERFACE_INCLUDE_DIRECTORIES)
    get_target_property(v ${t} ${p})
    if(v)
      foreach(f IN LISTS v)
        message(STATUS "gpu-deps-file: ${f}")
      endforeach()
    endif()
  endforeach()
endforeach()
add_executable(probe probe.cpp)
target_include_directories(probe PRIVATE ${XXHASH_INCLUDE_DIR})
target_link_libraries(probe PRIVATE hwy::hwy GTest::gtest_main GTest::gmock benchmark::benchmark CLI11::CLI11
                                    nlohmann_json::nlohmann_json)
EOF
  cat >"$probe/probe.cpp" <<'EOF'
#define XXH_INLINE_ALL
#include <CLI/CLI.hpp>
#include <benchmark/benchmark.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <nlohmann/json.hpp>
#include <xxhash.h>
TEST(GpuDeps, EveryPackageLinksAndRuns) {
  EXPECT_EQ(nlohmann::json::parse("[7]")[0].get<int>(), 7);
  EXPECT_NE(XXH3_64bits("stepfuse", 8), 0u);
  CLI::App app{"probe"};
  EXPECT_THAT(app.get_description(), ::testing::HasSubstr("probe"));
  EXPECT_NE(hwy::SupportedTargets(), 0);
  benchmark::State* unused = nullptr;
  (void)unused;
}
EOF
  local args
  mapfile -t args < <(dep_cmake_args "$abs")
  if ! cmake -S "$probe" -B "$probe/build" "${args[@]}" >"$probe/configure.log" 2>&1; then
    cat "$probe/configure.log"
    die "CMake does not find the packages in $deps (above)"
  fi
  local outside
  outside=$(grep -o 'gpu-deps-file: .*' "$probe/configure.log" | sed 's/^gpu-deps-file: //' | grep -v "^$abs/" || true)
  [[ -z $outside ]] || die "the package files point outside $deps: $outside"
  echo "gpu_check --prepare: CMake finds all packages in $deps alone ($(grep -c 'gpu-deps-file: ' "$probe/configure.log") files, all inside it)"
  if ! cmake --build "$probe/build" --parallel "$jobs" >"$probe/build.log" 2>&1 || ! "$probe/build/probe" --gtest_brief=1 >"$probe/run.log" 2>&1; then
    cat "$probe/build.log" "$probe/run.log" 2>/dev/null | tail -n 40
    die "a program using the copied packages does not build or run (above)"
  fi
  echo "gpu_check --prepare: a program using every package builds and runs against $deps"
  local mib
  # The Python package's build requirements, as wheels (the GPU machine has no package
  # registry): its CUDA tests run there when that machine's Python has torch.
  if command -v python3 >/dev/null 2>&1; then
    python3 -m pip download -q --only-binary=:all: -d "$deps/wheels" "scikit-build-core>=0.10" "nanobind>=2.2" ||
      echo "gpu_check --prepare: could not download scikit-build-core and nanobind: the Python CUDA tests will not run there"
  fi
  mib=$(du -sm "$deps" | cut -f1)
  ((mib < 60)) || die "$deps is $mib MiB: too large to carry (limit 60)"
  echo "gpu_check --prepare: $deps is $mib MiB ($(find "$deps" -type f | wc -l) files); carry it to the GPU machine with the working tree"
}

if ((prepare)); then
  prepare_deps
  exit 0
fi

# ---- The check: there -----------------------------------------------------------------------
[[ -d $deps/lib && -d $deps/include ]] ||
  die "no $deps/: run 'scripts/gpu_check.sh --prepare' on a Debian machine with the dependencies, and carry $deps here"
abs_deps=$(cd "$deps" && pwd)
mapfile -t cmake_deps < <(dep_cmake_args "$abs_deps")
deps_lib=$(find "$abs_deps/lib" -mindepth 1 -maxdepth 1 -type d | head -n 1)
export LD_LIBRARY_PATH="$deps_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

mkdir -p "$build"
build=$(cd "$build" && pwd)
results=$build/gpu_check
[[ -n ${OUT:-} ]] && results=$OUT/gpu_check
rm -rf "$results"
mkdir -p "$results"
# Everything printed also goes to console.log; the exit trap waits for tee to finish.
exec > >(tee "$results/console.log") 2>&1
trap 'exec >&- 2>&-; wait' EXIT

t_start=$SECONDS
failed=()
phase_times=()
phase_start=$SECONDS
begin() {
  phase_start=$SECONDS
  echo
  echo "==> $*"
}
end() { phase_times+=("$(printf '%-22s %4ds' "$1" $((SECONDS - phase_start)))"); }

begin "machine"
gpu_line=
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu_line=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1 || true)
  [[ -n $gpu_line ]] || echo "GPU: none (nvidia-smi: $( (nvidia-smi -L 2>&1 || true) | head -n 1))"
else
  echo "GPU: none (no nvidia-smi)"
fi
[[ -n $gpu_line ]] && echo "GPU: $gpu_line (name, driver, memory)"
echo "CPU: $(nproc) cores; $(cmake --version | head -n 1); $(g++ --version | head -n 1)"
command -v nvcc >/dev/null 2>&1 && echo "nvcc: $(nvcc --version | tail -n 1)"
echo "dependencies: $deps ($(du -sm "$deps" | cut -f1) MiB), prepared from: $(grep -v '^#' "$deps/MANIFEST" 2>/dev/null | paste -sd ';' - || echo '?')"
end machine

begin "configure ($build, Release)"
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
if ! cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DSTEPFUSE_BUILD_TESTS=ON \
  -DSTEPFUSE_BUILD_BENCH=ON -DSTEPFUSE_BUILD_EXAMPLES=ON "${cmake_deps[@]}" >"$results/configure.log" 2>&1; then
  tail -n 40 "$results/configure.log"
  echo "gpu_check: FAILED: configure (log: $results/configure.log)"
  exit 1
fi
echo "configured"
end configure

tests=(cuda_loader_test kernel_cache_test)
[[ -f tests/cuda_codegen_test.cpp ]] && tests+=(cuda_codegen_test)
tests+=(cuda_gpu_test)
for t in custom_program_test emit_test nccl_communicator_test; do [[ -f tests/$t.cpp ]] && tests+=("$t"); done
examples=()
[[ -f examples/run_emitted/run_emitted.c ]] && examples=(stepfuse-emit-kernel stepfuse-run-emitted)
begin "build (${#tests[@]} test programs, ${#examples[@]} examples, stepfuse-bench; $jobs jobs)"
if ! cmake --build "$build" --parallel "$jobs" --target stepfuse "${tests[@]}" "${examples[@]}" stepfuse-bench \
  >"$results/build.log" 2>&1; then
  grep -E 'error|FAILED' "$results/build.log" | head -n 30
  tail -n 30 "$results/build.log"
  echo "gpu_check: FAILED: build (log: $results/build.log)"
  exit 1
fi
echo "built in $((SECONDS - phase_start)) s"
end build

# The tests, each with a fresh kernel cache directory of its own. cuda_codegen_test needs
# NVRTC, not the GPU, and takes a minute compiling every program on one core: it runs in the
# background, beside the other tests and the benchmarks (whose figures are GPU times).
begin "GPU tests"
test_summary=()
gpu_tests_skipped=0
run_test() {  # NAME: runs it, writes $results/NAME.log and $results/NAME.rc
  local t=$1 rc=0 t0=$SECONDS
  rm -rf "$build/gpu_check_cache/$t"
  STEPFUSE_CACHE_DIR=$build/gpu_check_cache/$t timeout 240 "$build/tests/$t" --gtest_brief=1 >"$results/$t.log" 2>&1 || rc=$?
  echo "$rc $((SECONDS - t0))" >"$results/$t.rc"
}
report_test() {  # NAME: prints its line (and failures), records it
  local t=$1 rc secs passed nfailed skipped line
  read -r rc secs <"$results/$t.rc"
  passed=$(sed -nE 's/^\[  PASSED  \] ([0-9]+) tests?\..*/\1/p' "$results/$t.log" | tail -n 1)
  nfailed=$(sed -nE 's/^\[  FAILED  \] ([0-9]+) tests?[,.].*/\1/p' "$results/$t.log" | tail -n 1)
  skipped=$(sed -nE 's/^\[  SKIPPED \] ([0-9]+) tests?[,.].*/\1/p' "$results/$t.log" | tail -n 1)
  line=$(printf '%-20s %4s passed %4s failed %4s skipped %4ds' "$t" "${passed:-0}" "${nfailed:-0}" "${skipped:-0}" "$secs")
  # What the tests print about themselves, and failures.
  grep -E '^\[ (prewarm|kernel cache|stand-in) ' "$results/$t.log" | head -n 20 || true
  if ((rc != 0)); then
    ((rc == 124)) && line+="  TIMED OUT"
    line+="  FAILED (exit $rc)"
    failed+=("$t")
    grep -vE '^\[ (prewarm|kernel cache|cost) ' "$results/$t.log" | head -n 120
  fi
  if [[ $t == cuda_gpu_test && ${passed:-0} == 0 ]]; then gpu_tests_skipped=1; fi
  test_summary+=("$line")
  echo "$line"
}
codegen_pid=
if [[ " ${tests[*]} " == *" cuda_codegen_test "* ]]; then
  run_test cuda_codegen_test &
  codegen_pid=$!
fi
for t in "${tests[@]}"; do
  [[ $t == cuda_codegen_test ]] && continue
  run_test "$t"
  report_test "$t"
done
# The emit example: kernels emitted at build time, launched by a C program without stepfuse.
if ((${#examples[@]})); then
  set +e
  timeout 120 "$build/examples/stepfuse-run-emitted" >"$results/run_emitted.log" 2>&1
  rc=$?
  set -e
  if ((rc != 0)); then
    failed+=("stepfuse-run-emitted (exit $rc)")
    tail -n 40 "$results/run_emitted.log"
    line=$(printf '%-20s %s' "stepfuse-run-emitted" "FAILED (exit $rc)")
  else
    line=$(printf '%-20s %s' "stepfuse-run-emitted" "$(tail -n 1 "$results/run_emitted.log")")
  fi
  test_summary+=("$line")
  echo "$line"
fi
set +e
STEPFUSE_CACHE_DIR=$build/gpu_check_cache/bench_smoke ctest --test-dir "$build" -L bench --output-on-failure \
  >"$results/bench_smoke.log" 2>&1
rc=$?
set -e
line=$(printf '%-20s %s' "stepfuse-bench smoke" "$(grep -E 'tests passed|tests failed' "$results/bench_smoke.log" | tail -n 1)")
if ((rc != 0)); then
  failed+=("stepfuse-bench smoke tests")
  tail -n 60 "$results/bench_smoke.log"
fi
test_summary+=("$line")
echo "$line"
end tests

# The benchmarks: a fresh kernel cache, so that the first preset's optimizer compiles cold
# and the second one's (the same spec) is a disk-cache hit.
begin "benchmarks: stepfuse-bench --backend cuda ${bench_args[*]}"
rm -rf "$build/gpu_check_cache/bench"
export STEPFUSE_CACHE_DIR=$build/gpu_check_cache/bench
bench_bin=$build/bench/stepfuse-bench
no_gpu_reason=
torch_ok=0
if ((!skip_torch)) && timeout 120 python3 -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
  torch_ok=1
  echo "PyTorch $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null) sees the GPU: timing its step too"
elif ((!skip_torch)); then
  echo "PyTorch: not usable with the GPU here (python3 -c 'import torch; assert torch.cuda.is_available()' failed): no baseline"
fi
for p in "${presets[@]}"; do
  "$bench_bin" --preset "$p" --print-shapes >"$results/$p.shapes"
  set +e
  timeout 240 "$bench_bin" --backend cuda --preset "$p" "${bench_args[@]}" --json "$results/stepfuse-$p.json" \
    >"$results/stepfuse-$p.log" 2>&1
  rc=$?
  set -e
  cat "$results/stepfuse-$p.log"
  if ((rc == 1)) && grep -q 'the CUDA backend cannot run here' "$results/stepfuse-$p.log"; then
    no_gpu_reason=$(sed -nE 's/.*the CUDA backend cannot run here: (.*); use --backend cpu.*/\1/p' "$results/stepfuse-$p.log" | head -n 1)
    rm -f "$results/stepfuse-$p.json"
    break
  elif ((rc != 0)); then
    failed+=("stepfuse-bench $p (exit $rc)")
    rm -f "$results/stepfuse-$p.json"
  fi
  if ((torch_ok)); then
    set +e
    timeout 240 python3 bench/peers/torch_cuda_step.py --shapes "$results/$p.shapes" --weights bf16 --grads bf16 \
      --clip 1.0 --loss-scale 1024 --steps 50 --warmup 10 >"$results/torch-$p.json" 2>"$results/torch-$p.log"
    rc=$?
    set -e
    if ((rc != 0)); then
      failed+=("torch_cuda_step.py $p (exit $rc)")
      tail -n 20 "$results/torch-$p.log" "$results/torch-$p.json"
    else
      echo "torch $p: $(python3 -c 'import json,sys; print("%.3f ms per step (median)" % json.load(open(sys.argv[1]))["ms"]["median"])' "$results/torch-$p.json")"
    fi
  fi
done
# Optimizer state stored as bf16 and as q8 (the moments in 2 bytes, or 1 byte and an absmax
# per 256): each run verified bit for bit against the CPU before timing; its fraction of the
# device-to-device copy counts the bytes its own state format moves.
if [[ -z $no_gpu_reason ]]; then
  for st in bf16 q8; do
    set +e
    timeout 240 "$bench_bin" --backend cuda --preset gpt2-124m "${bench_args[@]}" --state "$st" \
      --json "$results/stepfuse-gpt2-124m-$st.json" >"$results/stepfuse-gpt2-124m-$st.log" 2>&1
    rc=$?
    set -e
    cat "$results/stepfuse-gpt2-124m-$st.log"
    ((rc == 0)) || failed+=("stepfuse-bench gpt2-124m --state $st (exit $rc)")
  done
fi
end benchmarks

# The Python package's CUDA tests (python/tests/test_torch_cuda.py: stepfuse.torch against
# torch's fused AdamW and GradScaler on the GPU, stream order, CUDA graph capture), when this
# machine's python3 has torch with the GPU: a venv over the system's packages, the build
# requirements from .gpu-deps/wheels, pip install . against .gpu-deps.
if ((torch_ok)) && [[ -d $abs_deps/wheels ]]; then
  begin "python: stepfuse.torch on the GPU"
  pyvenv=$build/pyvenv
  set +e
  { [[ -x $pyvenv/bin/python ]] || python3 -m venv --system-site-packages "$pyvenv"; } &&
    "$pyvenv/bin/python" -m pip install -q --no-index --find-links "$abs_deps/wheels" scikit-build-core nanobind &&
    CMAKE_ARGS="${cmake_deps[*]}" CMAKE_BUILD_PARALLEL_LEVEL=$jobs \
      "$pyvenv/bin/python" -m pip install -q --no-build-isolation --no-deps . >"$results/python_build.log" 2>&1
  rc=$?
  if ((rc == 0)); then
    "$pyvenv/bin/python" -m pytest python/tests/test_torch_cuda.py -q -p no:cacheprovider 2>&1 | tee "$results/python_cuda.log"
    rc=${PIPESTATUS[0]}
    line="python CUDA tests: $(tail -n 1 "$results/python_cuda.log")"
  else
    tail -n 40 "$results/python_build.log"
    line="python CUDA tests: the package did not build (exit $rc; $results/python_build.log)"
  fi
  set -e
  ((rc == 0)) || failed+=("python CUDA tests")
  test_summary+=("$line")
  echo "$line"
  end python
fi

if [[ -n $codegen_pid ]]; then
  begin "cuda_codegen_test (NVRTC only; ran in the background)"
  wait "$codegen_pid" || true
  report_test cuda_codegen_test
  end cuda_codegen_test
fi

# ---- The table ------------------------------------------------------------------------------
echo
echo "==> summary"
echo "GPU: ${gpu_line:-none}"
printf '  %s\n' "${test_summary[@]}"
if command -v python3 >/dev/null 2>&1; then
  python3 - "$results" "${presets[@]}" <<'EOF' | tee "$results/table.txt"
import json, os, sys
results, presets = sys.argv[1], sys.argv[2:]
def load(name):
    try:
        with open(os.path.join(results, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
rows = []
for p in presets:
    s, t = load(f"stepfuse-{p}.json"), load(f"torch-{p}.json")
    if s is None:
        rows.append((p, "no result") + ("",) * 7)
        continue
    ms = s["fused"]["ms"]["median"]
    torch_ms = t["ms"]["median"] if t and "ms" in t else None
    rows.append((p, f"{ms:.3f}", f"{s['fused']['gbs']:.0f}", f"{s['d2d_copy']['gbs_median']:.0f}",
                 f"{s['per_iteration']['fused_fraction_of_d2d_copy']['median']:.2f}",
                 str(s["fused"]["kernel_launches_per_step"]),
                 f"{torch_ms:.3f}" if torch_ms else "-", f"{torch_ms / ms:.2f}x" if torch_ms else "-",
                 f"{s['step_bytes']['per_step'] / 1e9:.2f}"))
head = ("preset", "stepfuse ms", "GB/s", "D2D GB/s", "ratio", "launches", "torch ms", "speedup", "GB/step")
widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
fmt = "  ".join("{:<%d}" % widths[0] if i == 0 else "{:>%d}" % w for i, w in enumerate(widths))
print("AdamW, clip 1.0, bf16 weights + bf16 grads + fp32 masters, loss scale 1024; medians of 50 steps (CUDA events);")
print("GB/s: the bytes the step must move / time; ratio: the same against a 1 GiB device-to-device copy, per iteration;")
print("torch: GradScaler.unscale_ + clip_grad_norm_(foreach) + AdamW(fused) + fp32<->bf16 master copies.")
print(fmt.format(*head))
for r in rows:
    print(fmt.format(*r))
caches = [load(f"stepfuse-{p}.json") for p in presets]
caches = [c["kernel_cache"] for c in caches if c]
if caches:
    cold = next((c["cold_compile_ms"] for c in caches if c.get("cold_compile_ms") is not None), None)
    firsts = ", ".join(f"{p}: {c['first_construction']} ({c['construct_ms']:.0f} ms)" for p, c in zip(presets, caches))
    disk = [c["disk_hit_ms"] for c in caches if c.get("disk_hit_ms") is not None]
    mem = [c["memory_hit_us"] for c in caches]
    print("kernel cache: cold compile %s; disk-cache hit %s; memory-cache hit %.1f us  (first optimizer per run: %s)" % (
        "%.0f ms" % cold if cold is not None else "-", "%.2f ms" % min(disk) if disk else "-", min(mem), firsts))
EOF
else
  echo "(no python3: the figures are in $results/stepfuse-*.json and torch-*.json)"
fi
printf '  %s\n' "${phase_times[@]}"
echo "total $((SECONDS - t_start)) s; logs and reports in $results"

if ((${#failed[@]})); then
  echo "gpu_check: FAILED: ${failed[*]}"
  exit 1
fi
if [[ -n $no_gpu_reason || -z $gpu_line || $gpu_tests_skipped == 1 ]]; then
  why=${no_gpu_reason:-nvidia-smi sees no GPU}
  if ((no_gpu_ok)); then
    echo "gpu_check: no GPU ($why): the GPU tests skipped and the CUDA benchmark could not run (--no-gpu-ok: exit 0)"
    exit 0
  fi
  echo "gpu_check: no GPU ($why): the GPU tests skipped and the CUDA benchmark could not run"
  exit 3
fi
echo "gpu_check: all passed"
