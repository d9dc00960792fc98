# Smoke tests of stepfuse-bench's command line (label "bench"), run with cmake -P:
#   cmake -DBENCH=<stepfuse-bench> -DDIR=<scratch dir> -DCASE=<case> -P stepfuse_bench_cli_test.cmake
# Cases:
#   shapes_run      a tiny --shapes file, every fusion mode, --json: exit 0 and the JSON's keys
#   print_resnet50  --preset resnet50 --print-shapes: 161 "NAME COUNT" lines, 25,557,032 elements
#   roundtrip       --print-shapes output read back with --shapes prints the same list
#   bad_shapes      a shapes file with a bad count: exit 1, the message names file and line
#   usage           --preset with --shapes, an unknown --fusion mode: exit 1 with a clear message
#   cuda_backend    --backend cuda: without a usable GPU exit 1 saying why ("the CUDA backend cannot
#                   run here: no CUDA driver ..."); with one, a tiny run: exit 0 and the JSON's figures
#   cpu_backend     -DHAVE_LLVM=ON: a tiny run with --cpu-backend highway,llvm: exit 0, the bitwise check, the
#                   fused-llvm row and the "llvm / highway" ratio line, the JSON's figures; OFF: the same
#                   command exits 1 saying the build has no LLVM, and the default times Highway alone
#   cpu_backend_usage  --cpu-backend bogus, and --cpu-backend without a fused mode: exit 1 with a clear message
#   groups          a shapes file with matrices (dims) and 1-D tensors: --groups compare (every mode with one
#                   group and two: the group sizes, the -2g rows, the ratio lines, the JSON's figures), --groups
#                   on, --print-shapes --groups read back, and the usage errors (no 1-D tensor / no matrix,
#                   --backend cuda, a bad shape)
#   rounding        --rounding nearest,stochastic --weights bf16 --masters off on a tiny list: exit 0, the check of
#                   fused-sr against fused, the fused-sr row (and fused-llvm-sr with -DHAVE_LLVM=ON, checked
#                   bitwise), the "stochastic / nearest" ratios, the JSON's figures; --no-masters as --masters off;
#                   the usage errors (f32 weights, masters kept, --masters with --no-masters, no fused mode,
#                   --backend cuda, --ranks)
#   compensated     --masters compensated --weights bf16 on a tiny list, every fusion mode: exit 0, the weights
#                   line naming the compensations, their bytes in the step's (AdamW bf16: 28 B/param) and in the
#                   model's, the JSON's figures (and the bitwise LLVM check with -DHAVE_LLVM=ON); --help names it;
#                   --backend cuda as the cuda_backend case (no GPU: exit 1 saying why; else a run); the usage
#                   errors (f32 and f16 weights, --rounding stochastic, --ranks, with --no-masters)
#   state           --state f32,bf16,q8 with --weights bf16 --masters off --rounding nearest,stochastic on a
#                   tiny list: exit 0, each state's bytes (q8: codes and absmaxes, AdamW 12.0625 B/param), the
#                   bitwise checks against unfused-bf16s / unfused-q8 (and the -sr and, with -DHAVE_LLVM=ON,
#                   -llvm twins), the -bf16s and -q8 rows with their B/param, the "state / f32 state" ratios, the
#                   JSON's figures; q8 alone on a list with a tensor under min_q8_numel (4096: f32 state) and
#                   --groups compare; --help names it; the usage errors (a bad format, --backend cuda, no fused
#                   mode, ASGD, --ranks with a list)
#   ranks           -DHAVE_MPI=ON (-DMPIEXEC=<mpiexec>): --ranks 2 (stepfuse-bench starts mpiexec itself) with
#                   slices and with whole tensors: exit 0, the table, one all_gather per step of the bytes the
#                   layout gives, the JSON's figures; --ranks 1 --json-only; under mpiexec -n 1 with --ranks 2,
#                   and too many ranks for the model: exit 1 saying why; --state q8 (one format) on 2 ranks.
#                   OFF: --ranks exits 1 saying the build
#                   has no MPI and how to get it. Both: --shard without --ranks is a usage error
cmake_minimum_required(VERSION 3.20)
foreach(var BENCH DIR CASE)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "stepfuse_bench_cli_test.cmake: pass -D${var}=...")
  endif()
endforeach()
file(MAKE_DIRECTORY "${DIR}")

# Runs stepfuse-bench with ARGN; sets rc, out, err in the caller.
macro(bench)
  execute_process(COMMAND "${BENCH}" ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
endmacro()
function(expect_rc want what)
  if(NOT rc STREQUAL "${want}")
    message(FATAL_ERROR "${what}: exit code ${rc}, expected ${want}\nstdout:\n${out}\nstderr:\n${err}")
  endif()
endfunction()
function(expect_in haystack needle what)
  string(FIND "${haystack}" "${needle}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${what}: expected to find '${needle}' in:\n${haystack}")
  endif()
endfunction()

if(CASE STREQUAL "shapes_run")
  file(WRITE "${DIR}/tiny.shapes" "# a tiny tensor list: names, suffixes, comments, a blank line, an empty tensor\n"
                                  "embed.weight 4k\n\nnorm.weight 100   # trailing comment\n3000\nempty 0\n")
  file(REMOVE "${DIR}/tiny.json")
  bench(--shapes "${DIR}/tiny.shapes" --steps 2 --warmup 0 --rss-steps 1 --threads 1
        --fusion fused,unfused,interpreted --json "${DIR}/tiny.json")
  expect_rc(0 "shapes_run")
  expect_in("${out}" "shapes file ${DIR}/tiny.shapes: 4 tensors, 7,100 parameters" "shapes_run stdout")
  expect_in("${out}" "fused/interpreted speed ratio" "shapes_run stdout")
  file(READ "${DIR}/tiny.json" j)
  string(JSON params GET "${j}" config params)
  string(JSON tensors GET "${j}" config tensors)
  string(JSON shapes_file GET "${j}" config shapes_file)
  string(JSON backend GET "${j}" config backend)
  string(JSON nfusion LENGTH "${j}" config fusion)
  if(NOT params EQUAL 7100 OR NOT tensors EQUAL 4 OR NOT shapes_file STREQUAL "${DIR}/tiny.shapes"
     OR NOT backend STREQUAL "cpu" OR NOT nfusion EQUAL 3)
    message(FATAL_ERROR "shapes_run: config is wrong: params=${params} tensors=${tensors} "
                        "shapes_file=${shapes_file} backend=${backend} fusion modes=${nfusion}")
  endif()
  foreach(key fused unfused interpreted fused_over_unfused_speed fused_over_interpreted_speed
              interpreted_over_unfused_speed bandwidth verification)
    string(JSON type ERROR_VARIABLE missing TYPE "${j}" ${key})
    if(missing)
      message(FATAL_ERROR "shapes_run: the JSON has no '${key}': ${missing}")
    endif()
  endforeach()
  string(JSON samples LENGTH "${j}" interpreted samples_ms)
  string(JSON npairs LENGTH "${j}" verification pairs)
  if(NOT samples EQUAL 2 OR NOT npairs EQUAL 2)
    message(FATAL_ERROR "shapes_run: ${samples} interpreted samples (expected 2), ${npairs} verified pairs (expected 2)")
  endif()

elseif(CASE STREQUAL "print_resnet50")
  bench(--preset resnet50 --print-shapes)
  expect_rc(0 "print_resnet50")
  string(REGEX REPLACE "\n$" "" body "${out}")
  string(REPLACE "\n" ";" lines "${body}")
  list(LENGTH lines n)
  set(total 0)
  foreach(line IN LISTS lines)
    if(NOT line MATCHES "^([A-Za-z0-9_.]+) ([0-9]+)$")
      message(FATAL_ERROR "print_resnet50: not a 'NAME COUNT' line: '${line}'")
    endif()
    math(EXPR total "${total} + ${CMAKE_MATCH_2}")
  endforeach()
  if(NOT n EQUAL 161 OR NOT total EQUAL 25557032)
    message(FATAL_ERROR "print_resnet50: ${n} lines and ${total} elements, expected 161 and 25557032")
  endif()
  expect_in("${out}" "layer1.0.conv1.weight 4096\n" "print_resnet50")
  expect_in("${out}" "fc.weight 2048000\nfc.bias 1000\n" "print_resnet50")

elseif(CASE STREQUAL "roundtrip")
  foreach(preset gpt2-124m resnet50 llama7b-layer)
    bench(--preset ${preset} --print-shapes)
    expect_rc(0 "roundtrip ${preset}")
    if(NOT out MATCHES "^[^\n]+ [0-9]+\n")
      message(FATAL_ERROR "roundtrip ${preset}: --print-shapes printed no 'NAME COUNT' list:\n${out}")
    endif()
    set(first "${out}")
    file(WRITE "${DIR}/${preset}.shapes" "${out}")
    bench(--shapes "${DIR}/${preset}.shapes" --print-shapes)
    expect_rc(0 "roundtrip ${preset} read back")
    if(NOT out STREQUAL first)
      message(FATAL_ERROR "roundtrip ${preset}: --shapes of --print-shapes prints a different list")
    endif()
  endforeach()

elseif(CASE STREQUAL "bad_shapes")
  file(WRITE "${DIR}/bad.shapes" "# fine so far\nwte 38597376\nwpe 12x\n")
  bench(--shapes "${DIR}/bad.shapes" --steps 1)
  expect_rc(1 "bad_shapes")
  expect_in("${err}" "${DIR}/bad.shapes: line 3: '12x' is not an element count for tensor 'wpe'" "bad_shapes")
  file(WRITE "${DIR}/dup.shapes" "a 10\nb 20\na 30\n")
  bench(--shapes "${DIR}/dup.shapes" --print-shapes)
  expect_rc(1 "bad_shapes (duplicate name)")
  expect_in("${err}" "line 3: tensor name 'a' is already used on line 1" "bad_shapes (duplicate name)")
  bench(--shapes "${DIR}/no-such-file.shapes")
  expect_rc(1 "bad_shapes (missing file)")
  expect_in("${err}" "no-such-file.shapes: cannot open" "bad_shapes (missing file)")

elseif(CASE STREQUAL "usage")
  file(WRITE "${DIR}/one.shapes" "1000\n")
  bench(--preset resnet50 --shapes "${DIR}/one.shapes")
  expect_rc(1 "usage (--preset with --shapes)")
  expect_in("${err}" "excludes" "usage (--preset with --shapes)")
  bench(--shapes "${DIR}/one.shapes" --fusion fused,jit)
  expect_rc(1 "usage (--fusion with an unknown mode)")

elseif(CASE STREQUAL "cuda_backend")
  file(WRITE "${DIR}/two.shapes" "a 5000\nb 17\n")
  file(REMOVE "${DIR}/cuda.json")
  bench(--shapes "${DIR}/two.shapes" --backend cuda --optimizer adamw --weights bf16 --grads bf16 --steps 2
        --warmup 1 --json "${DIR}/cuda.json")
  if(rc STREQUAL "1")  # no GPU here: the reason, and what to do instead
    expect_in("${err}" "stepfuse-bench: --backend cuda: the CUDA backend cannot run here: " "cuda_backend")
    expect_in("${err}" "; use --backend cpu" "cuda_backend")
    if(NOT err MATCHES "cannot run here: (no CUDA driver|NVRTC not found|no device)")
      message(FATAL_ERROR "cuda_backend: the message does not say what is missing:\n${err}")
    endif()
  else()
    expect_rc(0 "cuda_backend (a GPU is usable)")
    expect_in("${out}" "backend cuda" "cuda_backend stdout")
    file(READ "${DIR}/cuda.json" j)
    string(JSON backend GET "${j}" config backend)
    string(JSON launches GET "${j}" fused kernel_launches_per_step)
    string(JSON copy GET "${j}" d2d_copy gbs_median)
    string(JSON samples LENGTH "${j}" fused samples_ms)
    if(NOT backend STREQUAL "cuda" OR launches LESS 1 OR NOT samples EQUAL 2 OR NOT copy GREATER 0)
      message(FATAL_ERROR "cuda_backend: the JSON is wrong: backend=${backend} launches=${launches} "
                          "samples=${samples} d2d copy GB/s=${copy}")
    endif()
  endif()
  bench(--shapes "${DIR}/two.shapes" --backend cuda --fusion fused,unfused)
  expect_rc(1 "cuda_backend (--fusion unfused)")

elseif(CASE STREQUAL "cpu_backend")
  file(REMOVE "${DIR}/llvm.json")
  set(tiny --preset flat:100000 --steps 3 --warmup 1 --rss-steps 1 --optimizer adamw --weights bf16 --grads bf16)
  bench(${tiny} --cpu-backend highway,llvm --json "${DIR}/llvm.json")
  if(HAVE_LLVM)
    expect_rc(0 "cpu_backend")
    expect_in("${out}" " · LLVM " "cpu_backend header")
    expect_in("${out}" "one fused-llvm and one fused (Highway) step are bitwise equal" "cpu_backend stdout")
    expect_in("${out}" "\n  fused-llvm " "cpu_backend stdout (table row)")
    expect_in("${out}" "  llvm / highway: " "cpu_backend stdout (ratio line)")
    expect_in("${out}" "x faster (median of per-iteration ratios, " "cpu_backend stdout (ratio line)")
    expect_in("${out}" "LLVM optimizer construction: " "cpu_backend stdout")
    file(READ "${DIR}/llvm.json" j)
    string(JSON samples LENGTH "${j}" fused_llvm samples_ms)
    string(JSON hw_samples LENGTH "${j}" fused samples_ms)
    string(JSON speed GET "${j}" fused_llvm_over_fused_speed)
    string(JSON per_it GET "${j}" per_iteration fused_llvm_over_fused_speed median)
    string(JSON bitwise GET "${j}" verification llvm_vs_highway bitwise_equal)
    string(JSON nbackends LENGTH "${j}" config cpu_backends)
    string(JSON version GET "${j}" llvm version)
    if(NOT samples EQUAL 3 OR NOT hw_samples EQUAL 3 OR NOT speed GREATER 0 OR NOT per_it GREATER 0
       OR NOT bitwise OR NOT nbackends EQUAL 2 OR version STREQUAL "")
      message(FATAL_ERROR "cpu_backend: the JSON is wrong: fused_llvm samples=${samples} fused samples=${hw_samples} "
                          "speed=${speed} per-iteration=${per_it} bitwise=${bitwise} backends=${nbackends} "
                          "llvm version=${version}")
    endif()
  else()
    expect_rc(1 "cpu_backend (no LLVM)")
    expect_in("${err}" "--cpu-backend llvm: this stepfuse was built without LLVM" "cpu_backend (no LLVM)")
    bench(${tiny})
    expect_rc(0 "cpu_backend (no LLVM, default)")
    if(out MATCHES "fused-llvm|llvm / highway")
      message(FATAL_ERROR "cpu_backend: without LLVM the default timed an LLVM step:\n${out}")
    endif()
  endif()

elseif(CASE STREQUAL "cpu_backend_usage")
  bench(--preset flat:1000 --cpu-backend bogus)
  expect_rc(1 "cpu_backend_usage (bogus)")
  expect_in("${err}" "stepfuse-bench: --cpu-backend: unknown CPU backend 'bogus' (expected highway or llvm" "cpu_backend_usage")
  bench(--preset flat:1000 --fusion unfused --cpu-backend highway)
  expect_rc(1 "cpu_backend_usage (no fused mode)")
  expect_in("${err}" "--fusion times no fused step" "cpu_backend_usage (no fused mode)")

elseif(CASE STREQUAL "groups")
  file(WRITE "${DIR}/layers.shapes" "# two layers: matrices by their dims, biases and a norm by their counts\n"
                                    "w1 64x100\nb1 100\nln.weight 100\nw2 100x30\nb2 30\n")
  file(REMOVE "${DIR}/groups.json")
  bench(--shapes "${DIR}/layers.shapes" --groups compare --fusion fused,unfused,interpreted --steps 3 --warmup 1
        --rss-steps 1 --threads 1 --json "${DIR}/groups.json")
  expect_rc(0 "groups (compare)")
  expect_in("${out}" "param groups (--groups compare): decay: 2 tensors of rank >= 2, 9,400 parameters, weight_decay "
                     "0.01; no decay: 3 1-D tensors, 230 parameters, weight_decay 0" "groups (compare) stdout")
  expect_in("${out}" "verified before timing (two groups): one fused and one unfused step agree" "groups (compare)")
  expect_in("${out}" "\n  fused-2g " "groups (compare) stdout (table row)")
  expect_in("${out}" "\n  interpreted-2g " "groups (compare) stdout (table row)")
  expect_in("${out}" "  two groups / one group, step time (median of per-iteration ratios" "groups (compare) ratios")
  expect_in("${out}" "\n    unfused     " "groups (compare) ratio line")
  file(READ "${DIR}/groups.json" j)
  string(JSON mode GET "${j}" config groups)
  string(JSON ngroups LENGTH "${j}" config param_groups)
  string(JSON decay_tensors GET "${j}" config param_groups 0 tensors)
  string(JSON nodecay_params GET "${j}" config param_groups 1 params)
  string(JSON nodecay_wd GET "${j}" config param_groups 1 weight_decay)
  string(JSON samples LENGTH "${j}" interpreted_two_groups samples_ms)
  string(JSON ratio GET "${j}" fused_two_groups_over_one_group_time)
  string(JSON per_it GET "${j}" per_iteration unfused_two_groups_over_one_group_time median)
  string(JSON npairs LENGTH "${j}" verification_two_groups pairs)
  if(NOT mode STREQUAL "compare" OR NOT ngroups EQUAL 2 OR NOT decay_tensors EQUAL 2 OR NOT nodecay_params EQUAL 230
     OR NOT nodecay_wd EQUAL 0 OR NOT samples EQUAL 3 OR NOT ratio GREATER 0 OR NOT per_it GREATER 0
     OR NOT npairs EQUAL 2)
    message(FATAL_ERROR "groups: the JSON is wrong: groups=${mode} param_groups=${ngroups} decay tensors="
                        "${decay_tensors} no-decay params=${nodecay_params} no-decay weight_decay=${nodecay_wd} "
                        "two-group interpreted samples=${samples} fused ratio=${ratio} unfused per-iteration=${per_it} "
                        "two-group verified pairs=${npairs}")
  endif()
  bench(--shapes "${DIR}/layers.shapes" --groups on --fusion fused --steps 2 --warmup 0 --rss-steps 1 --threads 1)
  expect_rc(0 "groups (on)")
  expect_in("${out}" "param groups (--groups on): decay: 2 tensors" "groups (on) stdout")
  if(out MATCHES "-2g|two groups / one group")
    message(FATAL_ERROR "groups (on): timed one group as well:\n${out}")
  endif()
  # --print-shapes --groups writes the dims of matrices, which read back to the same list.
  bench(--shapes "${DIR}/layers.shapes" --groups on --print-shapes)
  expect_rc(0 "groups (print-shapes)")
  if(NOT out STREQUAL "w1 64x100\nb1 100\nln.weight 100\nw2 100x30\nb2 30\n")
    message(FATAL_ERROR "groups (print-shapes): printed\n${out}")
  endif()
  bench(--preset resnet50 --groups on --print-shapes)
  expect_in("${out}" "conv1.weight 64x3x7x7\nbn1.weight 64\n" "groups (resnet50 dims)")
  file(WRITE "${DIR}/resnet50.shapes" "${out}")
  set(first "${out}")
  bench(--shapes "${DIR}/resnet50.shapes" --groups on --print-shapes)
  if(NOT out STREQUAL first)
    message(FATAL_ERROR "groups: --shapes of --print-shapes --groups prints a different list")
  endif()
  # Usage errors.
  bench(--preset flat:1000 --groups on)
  expect_rc(1 "groups (flat: no matrix)")
  expect_in("${err}" "--groups: splits the tensors into matrices (weight decay) and 1-D tensors (none), but every "
                     "tensor of preset flat:1000 is 1-D" "groups (flat)")
  file(WRITE "${DIR}/counts.shapes" "wte 38597376\nln 768\n")
  bench(--shapes "${DIR}/counts.shapes" --groups compare)
  expect_rc(1 "groups (counts only)")
  expect_in("${err}" "give the dims of matrices, e.g. 'wte 50257x768'" "groups (counts only)")
  bench(--shapes "${DIR}/layers.shapes" --groups on --backend cuda)
  expect_rc(1 "groups (cuda)")
  expect_in("${err}" "--groups: stepfuse-bench times param groups on the CPU only" "groups (cuda)")
  file(WRITE "${DIR}/badshape.shapes" "w 64xq\n")
  bench(--shapes "${DIR}/badshape.shapes" --print-shapes)
  expect_rc(1 "groups (bad shape)")
  expect_in("${err}" "line 1: '64xq' is not a shape for tensor 'w' (expected dims joined by 'x'" "groups (bad shape)")

elseif(CASE STREQUAL "rounding")
  file(REMOVE "${DIR}/rounding.json")
  set(tiny --preset flat:100000 --steps 3 --warmup 1 --rss-steps 1 --optimizer adamw --weights bf16 --grads bf16)
  bench(${tiny} --masters off --rounding nearest,stochastic --json "${DIR}/rounding.json")
  expect_rc(0 "rounding")
  expect_in("${out}" "one fused-sr step (stochastic rounding, seed 1) is the fused step but for the rounding: the grad "
                     "norm, clip coefficient and state bitwise equal" "rounding stdout (verification)")
  expect_in("${out}" "\n  fused-sr " "rounding stdout (table row)")
  expect_in("${out}" "  stochastic / nearest rounding, step time (median of per-iteration ratios" "rounding ratios")
  expect_in("${out}" "\n    fused-sr / fused " "rounding ratio line")
  file(READ "${DIR}/rounding.json" j)
  string(JSON masters GET "${j}" config master_weights)
  string(JSON nroundings LENGTH "${j}" config rounding)
  string(JSON seed GET "${j}" config stochastic_rounding_seed)
  string(JSON state_rounding GET "${j}" config state_rounding)
  string(JSON sr_rounding GET "${j}" fused_sr rounding)
  string(JSON rn_rounding GET "${j}" fused rounding)
  string(JSON sr_bytes GET "${j}" fused_sr bytes_per_param)
  string(JSON rn_bytes GET "${j}" fused bytes_per_param)
  string(JSON samples LENGTH "${j}" fused_sr samples_ms)
  string(JSON ratio GET "${j}" fused_sr_over_fused_time)
  string(JSON per_it GET "${j}" per_iteration fused_sr_over_fused_time median)
  string(JSON checked GET "${j}" verification stochastic_vs_nearest ok)
  string(JSON apart GET "${j}" verification stochastic_vs_nearest weights_rounded_apart)
  if(masters OR NOT nroundings EQUAL 2 OR NOT seed EQUAL 1 OR NOT state_rounding STREQUAL "stochastic"
     OR NOT sr_rounding STREQUAL "stochastic"
     OR NOT rn_rounding STREQUAL "nearest" OR NOT sr_bytes EQUAL rn_bytes OR NOT samples EQUAL 3 OR NOT ratio GREATER 0
     OR NOT per_it GREATER 0 OR NOT checked OR NOT apart GREATER 0)
    message(FATAL_ERROR "rounding: the JSON is wrong: master_weights=${masters} roundings=${nroundings} seed=${seed} "
                        "state_rounding=${state_rounding} "
                        "fused_sr rounding=${sr_rounding} fused rounding=${rn_rounding} bytes/param=${sr_bytes} vs "
                        "${rn_bytes} fused_sr samples=${samples} ratio=${ratio} per-iteration=${per_it} "
                        "checked=${checked} weights rounded apart=${apart}")
  endif()
  if(HAVE_LLVM)  # the default --cpu-backend: highway,llvm
    expect_in("${out}" "one fused-llvm-sr and one fused-sr (Highway) step are bitwise equal" "rounding (llvm)")
    expect_in("${out}" "\n  fused-llvm-sr " "rounding stdout (llvm table row)")
    string(JSON bitwise GET "${j}" verification llvm_vs_highway_stochastic bitwise_equal)
    string(JSON llvm_ratio GET "${j}" fused_llvm_sr_over_fused_llvm_time)
    if(NOT bitwise OR NOT llvm_ratio GREATER 0)
      message(FATAL_ERROR "rounding (llvm): the JSON is wrong: bitwise=${bitwise} ratio=${llvm_ratio}")
    endif()
  endif()
  # --no-masters is --masters off; stochastic alone times the fused-sr row alone.
  bench(--preset flat:100000 --steps 1 --warmup 0 --rss-steps 1 --weights bf16 --grads bf16 --no-masters
        --rounding stochastic --fusion fused --cpu-backend highway --json-only)
  expect_rc(0 "rounding (--no-masters)")
  string(JSON masters GET "${out}" config master_weights)
  string(JSON sr_samples LENGTH "${out}" fused_sr samples_ms)
  string(JSON fused_type ERROR_VARIABLE no_fused TYPE "${out}" fused)
  if(masters OR NOT sr_samples EQUAL 1 OR NOT no_fused)
    message(FATAL_ERROR "rounding (--no-masters): the JSON is wrong: master_weights=${masters} fused_sr "
                        "samples=${sr_samples} fused row: ${fused_type}")
  endif()
  # Usage errors.
  foreach(args "--weights;f32;--masters;off" "--weights;bf16")
    bench(--preset flat:1000 --rounding stochastic ${args})
    expect_rc(1 "rounding (${args})")
    expect_in("${err}" "--rounding stochastic: rounds bf16 weights kept without fp32 masters; pass --weights bf16 "
                       "--masters off" "rounding (${args})")
  endforeach()
  bench(--preset flat:1000 --weights bf16 --masters off --rounding stochastic --state-rounding nearest)
  expect_rc(1 "rounding (--state-rounding nearest without --state bf16)")
  expect_in("${err}" "--state-rounding nearest: rounds the bf16 state of stochastically rounded weights"
            "rounding (--state-rounding nearest without --state bf16)")
  bench(--preset flat:1000 --weights bf16 --masters off --no-masters)
  expect_rc(1 "rounding (--masters with --no-masters)")
  expect_in("${err}" "excludes" "rounding (--masters with --no-masters)")
  set(sr --preset flat:100000 --weights bf16 --masters off --rounding stochastic)
  bench(${sr} --fusion unfused)
  expect_rc(1 "rounding (no fused mode)")
  expect_in("${err}" "--rounding stochastic: rounds the fused step's weights, and --fusion times no fused step"
            "rounding (no fused mode)")
  bench(${sr} --backend cuda)
  expect_rc(1 "rounding (--backend cuda)")
  expect_in("${err}" "--rounding stochastic: --backend cuda does not time it" "rounding (--backend cuda)")
  bench(${sr} --ranks 2)
  expect_rc(1 "rounding (--ranks)")
  if(NOT err MATCHES "--rounding stochastic: --ranks does not time the sharded step|built without MPI")
    message(FATAL_ERROR "rounding (--ranks): not the expected message:\n${err}")
  endif()

elseif(CASE STREQUAL "compensated")
  file(REMOVE "${DIR}/compensated.json")
  set(tiny --preset flat:100000 --steps 3 --warmup 1 --rss-steps 1 --optimizer adamw --weights bf16 --grads bf16)
  bench(${tiny} --masters compensated --fusion fused,unfused,interpreted --json "${DIR}/compensated.json")
  expect_rc(0 "compensated")
  expect_in("${out}" "AdamW · weights bf16 + bf16 compensations (--masters compensated) · grads bf16"
            "compensated stdout (weights)")
  # AdamW, bf16 weights and grads: reduce 2; update: read g 2 + w 2 + c 2 + m 4 + v 4, write w 2 + c 2 + m 4 + v 4.
  expect_in("${out}" "bytes the step must move: reduce 2 + update 26 = 28 B/param" "compensated stdout (bytes)")
  expect_in("${out}" "one interpreted and one unfused step agree" "compensated stdout (verification)")
  expect_in("${out}" "GiB weights+grads+state+compensations = " "compensated stdout (peak RSS)")
  file(READ "${DIR}/compensated.json" j)
  string(JSON masters GET "${j}" config master_weights)
  string(JSON compensated GET "${j}" config compensated_weights)
  string(JSON per_param GET "${j}" step_bytes per_param)
  string(JSON fused_bytes GET "${j}" fused bytes_per_param)
  string(JSON update_only_bytes GET "${j}" fused_update_only bytes_per_param)
  string(JSON comp_bytes GET "${j}" rss compensation_bytes)
  string(JSON master_bytes GET "${j}" rss master_bytes)
  string(JSON npairs LENGTH "${j}" verification pairs)
  if(masters OR NOT compensated OR NOT per_param EQUAL 28 OR NOT fused_bytes EQUAL 28 OR NOT update_only_bytes EQUAL 26
     OR NOT comp_bytes EQUAL 200000 OR NOT master_bytes EQUAL 0 OR NOT npairs EQUAL 2)
    message(FATAL_ERROR "compensated: the JSON is wrong: master_weights=${masters} compensated_weights=${compensated} "
                        "bytes/param=${per_param} (fused ${fused_bytes}, update alone ${update_only_bytes}) "
                        "compensation bytes=${comp_bytes} master bytes=${master_bytes} verified pairs=${npairs}")
  endif()
  if(HAVE_LLVM)  # the default --cpu-backend: highway,llvm; compensations compared bit for bit too
    expect_in("${out}" "one fused-llvm and one fused (Highway) step are bitwise equal" "compensated (llvm)")
    string(JSON bitwise GET "${j}" verification llvm_vs_highway bitwise_equal)
    if(NOT bitwise)
      message(FATAL_ERROR "compensated (llvm): the JSON is wrong: bitwise=${bitwise}")
    endif()
  endif()
  bench(--help)
  expect_rc(0 "compensated (--help)")
  expect_in("${out}" "Compensated bf16 weights (--masters compensated --weights bf16)" "compensated (--help)")
  # --backend cuda sets it as the CPU path does.
  bench(--preset flat:100000 --steps 2 --warmup 1 --weights bf16 --grads bf16 --masters compensated --backend cuda)
  if(rc STREQUAL "1")  # no GPU here: the reason, not the compensations
    expect_in("${err}" "stepfuse-bench: --backend cuda: the CUDA backend cannot run here: " "compensated (cuda)")
  else()
    expect_rc(0 "compensated (--backend cuda)")
    expect_in("${out}" "weights bf16 + bf16 compensations (--masters compensated)" "compensated (cuda) stdout")
    expect_in("${out}" "reduce 2 + update 26 = 28 B/param" "compensated (cuda) stdout (bytes)")
  endif()
  # Usage errors.
  foreach(weights f32 f16)
    bench(--preset flat:1000 --weights ${weights} --masters compensated)
    expect_rc(1 "compensated (--weights ${weights})")
    expect_in("${err}" "stepfuse-bench: --masters compensated: keeps a bf16 compensation beside each bf16 weight in "
                       "place of its fp32 master, and the weights are ${weights}; pass --weights bf16"
              "compensated (--weights ${weights})")
  endforeach()
  bench(--preset flat:1000 --weights bf16 --masters compensated --rounding nearest,stochastic)
  expect_rc(1 "compensated (--rounding stochastic)")
  expect_in("${err}" "stepfuse-bench: --masters compensated and --rounding stochastic exclude each other"
            "compensated (--rounding stochastic)")
  bench(--preset flat:100000 --weights bf16 --masters compensated --ranks 2)
  expect_rc(1 "compensated (--ranks)")
  expect_in("${err}" "--masters compensated: --ranks does not time the sharded step with compensated weights yet"
            "compensated (--ranks)")
  bench(--preset flat:1000 --weights bf16 --masters compensated --no-masters)
  expect_rc(1 "compensated (with --no-masters)")
  expect_in("${err}" "excludes" "compensated (with --no-masters)")

elseif(CASE STREQUAL "state")
  file(REMOVE "${DIR}/state.json")
  # 102,400 elements: 400 q8 blocks of 256, each with an fp32 absmax.
  set(tiny --preset flat:102400 --steps 3 --warmup 1 --rss-steps 1 --optimizer adamw --weights bf16 --grads bf16
           --masters off)
  bench(${tiny} --rounding nearest,stochastic --state f32,bf16,q8 --json "${DIR}/state.json")
  expect_rc(0 "state")
  expect_in("${out}" "AdamW · weights bf16 · grads bf16 · state f32, bf16, q8 · clip" "state stdout (config)")
  # AdamW, bf16 weights and grads, no masters: reduce 2; update: read g 2 + w 2, write w 2, and m and v read and
  # written at 4 (f32), 2 (bf16) or 1 + 4/256 (q8) bytes each.
  expect_in("${out}" "bytes the step must move: reduce 2 + update 22 = 24 B/param (2 state streams, f32)"
            "state stdout (f32 bytes)")
  expect_in("${out}" "  with bf16 state (the -bf16s rows): reduce 2 + update 14 = 16 B/param"
            "state stdout (bf16 bytes)")
  expect_in("${out}" "  with q8 state (the -q8 rows): reduce 2 + update 10.0625 = 12.0625 B/param"
            "state stdout (q8 bytes)")
  expect_in("${out}" "100.0% of the parameters, absmaxes counted" "state stdout (q8 share)")
  expect_in("${out}" "one fused-bf16s and one unfused-bf16s step are bitwise equal" "state stdout (bf16 check)")
  expect_in("${out}" "one fused-q8 and one unfused-q8 step are bitwise equal: 308,000 values" "state stdout (q8 check)")
  expect_in("${out}" "one fused-sr-q8 step (stochastic rounding, seed 1) is the fused-q8 step but for the rounding"
            "state stdout (q8 rounding check)")
  expect_in("${out}" "B/param     GB/s  % adam_like" "state stdout (B/param column)")
  foreach(row fused fused-bf16s fused-q8 fused-sr fused-sr-bf16s fused-sr-q8 unfused)
    expect_in("${out}" "\n  ${row} " "state stdout (row ${row})")
  endforeach()
  expect_in("${out}" "  state / f32 state, step time (median of per-iteration ratios" "state stdout (ratios)")
  expect_in("${out}" "\n    fused-q8 / fused " "state stdout (q8 ratio)")
  expect_in("${out}" "bytes 12.06 / 24 = 0.503x" "state stdout (q8 ratio bytes)")
  expect_in("${out}" "\n    fused-sr-q8 / fused-q8 " "state stdout (stochastic / nearest, q8)")
  file(READ "${DIR}/state.json" j)
  string(JSON nstates LENGTH "${j}" config state)
  string(JSON q8_bytes GET "${j}" fused_q8 bytes_per_param)
  string(JSON q8_state GET "${j}" fused_q8 state)
  string(JSON bf16_bytes GET "${j}" fused_sr_bf16s bytes_per_param)
  string(JSON f32_bytes GET "${j}" fused bytes_per_param)
  string(JSON by_state GET "${j}" step_bytes_by_state q8 per_param)
  string(JSON share GET "${j}" step_bytes_by_state q8 stored_fraction)
  string(JSON ratio GET "${j}" fused_q8_over_fused_time)
  string(JSON per_it GET "${j}" per_iteration fused_q8_over_fused_time median)
  string(JSON q8_checked GET "${j}" verification state_q8 unfused bitwise_equal)
  string(JSON q8_apart GET "${j}" verification state_q8 stochastic_vs_nearest weights_rounded_apart)
  string(JSON bf16_checked GET "${j}" verification state_bf16 unfused bitwise_equal)
  if(NOT nstates EQUAL 3 OR NOT q8_bytes EQUAL 12.0625 OR NOT q8_state STREQUAL "q8" OR NOT bf16_bytes EQUAL 16
     OR NOT f32_bytes EQUAL 24 OR NOT by_state EQUAL 12.0625 OR NOT share EQUAL 1 OR NOT ratio GREATER 0
     OR NOT per_it GREATER 0 OR NOT q8_checked OR NOT q8_apart GREATER 0 OR NOT bf16_checked)
    message(FATAL_ERROR "state: the JSON is wrong: states=${nstates} fused_q8 bytes/param=${q8_bytes} "
                        "state=${q8_state} fused_sr_bf16s bytes/param=${bf16_bytes} fused bytes/param=${f32_bytes} "
                        "step_bytes_by_state q8=${by_state} (share ${share}) ratio=${ratio} per-iteration=${per_it} "
                        "q8 checked=${q8_checked} (rounded apart ${q8_apart}) bf16 checked=${bf16_checked}")
  endif()
  if(HAVE_LLVM)  # the default --cpu-backend: highway,llvm
    expect_in("${out}" "one fused-llvm-q8 and one fused-q8 (Highway) step are bitwise equal" "state (llvm)")
    expect_in("${out}" "one fused-llvm-sr-bf16s and one fused-sr-bf16s (Highway) step are bitwise equal"
              "state (llvm, stochastic)")
    expect_in("${out}" "\n  fused-llvm-sr-q8 " "state stdout (llvm table row)")
    string(JSON bitwise GET "${j}" verification state_q8 llvm_vs_highway bitwise_equal)
    string(JSON llvm_ratio GET "${j}" fused_llvm_q8_over_fused_llvm_time)
    if(NOT bitwise OR NOT llvm_ratio GREATER 0)
      message(FATAL_ERROR "state (llvm): the JSON is wrong: bitwise=${bitwise} ratio=${llvm_ratio}")
    endif()
  endif()
  # q8 alone, with a tensor under min_q8_numel (4096: its state stays f32) and two param groups.
  file(WRITE "${DIR}/mixed.shapes" "big 64x128\nsmall 1000\n")
  bench(--shapes "${DIR}/mixed.shapes" --steps 2 --warmup 0 --rss-steps 1 --state q8 --fusion fused
        --cpu-backend highway --groups compare)
  expect_rc(0 "state (q8 alone)")
  # AdamW, f32: reduce 4; update 4 + 4 + 4, and m and v: (8192 + 32 * 4 + 1000 * 4) / 9192 bytes each way.
  expect_in("${out}" "  with q8 state (the -q8 rows): reduce 4 + update 17.3612 = 21.3612 B/param"
            "state (q8 alone: bytes)")
  expect_in("${out}" "89.1% of the parameters" "state (q8 alone: share)")
  expect_in("${out}" "one fused-q8 and one unfused-q8 step are bitwise equal" "state (q8 alone: check)")
  expect_in("${out}" "\n  fused-q8-2g " "state (q8 alone: two-group row)")
  expect_in("${out}" "GiB weights+grads+q8 state = " "state (q8 alone: peak RSS)")
  bench(--help)
  expect_rc(0 "state (--help)")
  expect_in("${out}" "Optimizer state formats (--state f32,bf16,q8)" "state (--help)")
  # Usage errors.
  bench(--preset flat:1000 --state q4)
  expect_rc(1 "state (bad format)")
  expect_in("${err}" "--state: q4 not in {f32,bf16,q8}" "state (bad format)")
  bench(--preset flat:1000 --state f32,q8 --backend cuda)
  expect_rc(1 "state (--backend cuda)")
  expect_in("${err}" "stepfuse-bench: --state f32,q8: --backend cuda times one state format per run"
            "state (--backend cuda)")
  # One format with --backend cuda: timed there, verified bit for bit against the CPU.
  bench(--preset flat:100000 --steps 2 --warmup 1 --state q8 --backend cuda)
  if(rc STREQUAL "1")  # no GPU here: the reason, not the state format
    expect_in("${err}" "stepfuse-bench: --backend cuda: the CUDA backend cannot run here: " "state (cuda)")
  else()
    expect_rc(0 "state (--backend cuda)")
    expect_in("${out}" " · state q8 · " "state (cuda) stdout")
    expect_in("${out}" "100.0% bitwise" "state (cuda) stdout (verified)")
  endif()
  bench(--preset flat:1000 --state bf16 --fusion unfused)
  expect_rc(1 "state (no fused mode)")
  expect_in("${err}" "--state bf16: stores the fused step's state, and --fusion times no fused step"
            "state (no fused mode)")
  bench(--preset flat:1000 --state q8 --optimizer asgd)
  expect_rc(1 "state (asgd)")
  expect_in("${err}" "stepfuse-bench: --state q8: the library rejects this configuration: " "state (asgd)")
  expect_in("${err}" "full precision" "state (asgd)")
  bench(--preset flat:100000 --state f32,q8 --ranks 2)
  expect_rc(1 "state (--ranks)")
  if(NOT err MATCHES "--ranks: times one --state format|built without MPI")
    message(FATAL_ERROR "state (--ranks): not the expected message:\n${err}")
  endif()

elseif(CASE STREQUAL "ranks")
  bench(--preset flat:100000 --shard whole)
  expect_rc(1 "ranks (--shard without --ranks)")
  expect_in("${err}" "--shard: says how --ranks cuts the model; pass --ranks N" "ranks (--shard without --ranks)")
  if(NOT HAVE_MPI)
    bench(--preset flat:100000 --ranks 2)
    expect_rc(1 "ranks (no MPI)")
    expect_in("${err}" "--ranks: this stepfuse-bench was built without MPI" "ranks (no MPI)")
    expect_in("${err}" "scripts/install_deps.sh" "ranks (no MPI)")
    return()
  endif()
  # flat:100000 is 7 chunks, cut after 3 (49,152 elements): the ranks send 3 and 4 chunk values, + 2 flags.
  file(REMOVE "${DIR}/ranks.json")
  bench(--preset flat:100000 --ranks 2 --steps 2 --warmup 1 --threads 1 --json "${DIR}/ranks.json")
  expect_rc(0 "ranks (slices)")
  expect_in("${out}" "stepfuse-bench --ranks 2: the sharded step across 2 MPI processes" "ranks (slices) stdout")
  expect_in("${out}" "bitwise the same on every rank" "ranks (slices) verification")
  expect_in("${out}" "\n   max  " "ranks (slices) table")
  expect_in("${out}" "1 call per step (all_gather): 6 f64 per rank = 48 B sent and 48 B received" "ranks (slices)")
  expect_in("${out}" ": 3, 4; + 2 flags, padded to the largest rank's: 48 B per call expected from the layout (as counted)"
            "ranks (slices) layout")
  file(READ "${DIR}/ranks.json" j)
  string(JSON ranks GET "${j}" config ranks)
  string(JSON shard GET "${j}" config shard)
  string(JSON calls GET "${j}" collective calls_per_step)
  string(JSON sent GET "${j}" collective bytes_sent_per_rank)
  string(JSON nper LENGTH "${j}" per_rank)
  string(JSON el1 GET "${j}" per_rank 1 elements)
  string(JSON sharded GET "${j}" max_over_ranks sharded_step_ms)
  string(JSON gather GET "${j}" max_over_ranks all_gather_us)
  string(JSON reduce GET "${j}" max_over_ranks all_reduce_128B_us)
  string(JSON agree GET "${j}" verification ranks_agree)
  if(NOT ranks EQUAL 2 OR NOT shard STREQUAL "slices" OR NOT calls EQUAL 1 OR NOT sent EQUAL 48 OR NOT nper EQUAL 2
     OR NOT el1 EQUAL 50848 OR NOT sharded GREATER 0 OR NOT gather GREATER 0 OR NOT reduce GREATER 0 OR NOT agree)
    message(FATAL_ERROR "ranks (slices): the JSON is wrong: ranks=${ranks} shard=${shard} calls=${calls} sent=${sent} "
                        "per_rank=${nper} rank 1 elements=${el1} sharded ms=${sharded} all_gather us=${gather} "
                        "all_reduce us=${reduce} ranks_agree=${agree}")
  endif()
  # Whole tensors: a | b c (the boundary nearest half the elements); 1 and 2 values, + 2 flags.
  file(WRITE "${DIR}/three.shapes" "a 40000\nb 30000\nc 30000\n")
  bench(--shapes "${DIR}/three.shapes" --ranks 2 --shard whole --optimizer sgd --steps 1 --warmup 0 --threads 1
        --json-only)
  expect_rc(0 "ranks (whole)")
  string(JSON shard GET "${out}" config shard)
  string(JSON sent GET "${out}" collective bytes_sent_per_rank)
  string(JSON v0 GET "${out}" collective values_per_rank 0)
  string(JSON v1 GET "${out}" collective values_per_rank 1)
  string(JSON el0 GET "${out}" per_rank 0 elements)
  if(NOT shard STREQUAL "whole" OR NOT sent EQUAL 32 OR NOT v0 EQUAL 1 OR NOT v1 EQUAL 2 OR NOT el0 EQUAL 40000)
    message(FATAL_ERROR "ranks (whole): the JSON is wrong: shard=${shard} sent=${sent} values=${v0},${v1} "
                        "rank 0 elements=${el0}\n${out}")
  endif()
  bench(--preset flat:100000 --ranks 1 --steps 1 --warmup 0 --threads 1 --norm-type inf --json-only)
  expect_rc(0 "ranks (one rank)")
  string(JSON ranks GET "${out}" config ranks)
  string(JSON received GET "${out}" collective bytes_received_per_rank)
  if(NOT ranks EQUAL 1 OR NOT received EQUAL 0)
    message(FATAL_ERROR "ranks (one rank): the JSON is wrong: ranks=${ranks} received=${received}")
  endif()
  # One --state format: the sharded and the local step both store q8 state.
  bench(--preset flat:100000 --ranks 2 --state q8 --steps 1 --warmup 0 --threads 1 --json-only)
  expect_rc(0 "ranks (--state q8)")
  string(JSON state GET "${out}" config state)
  if(NOT state STREQUAL "q8")
    message(FATAL_ERROR "ranks (--state q8): the JSON is wrong: state=${state}")
  endif()
  # Usage errors: more ranks than the model has chunks (before mpiexec), a world of another size.
  bench(--preset flat:20000 --ranks 3)
  expect_rc(1 "ranks (too many ranks)")
  expect_in("${err}" "--ranks 3: the model has 2 16,384-element chunk(s)" "ranks (too many ranks)")
  bench(--preset flat:100000 --ranks 2 --backend cuda)
  expect_rc(1 "ranks (--backend cuda)")
  expect_in("${err}" "--ranks: the sharded step runs on the CPU so far" "ranks (--backend cuda)")
  if(MPIEXEC)
    execute_process(COMMAND ${CMAKE_COMMAND} -E env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
                            "${MPIEXEC}" -n 1 "${BENCH}" --preset flat:100000 --ranks 2
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
    expect_rc(1 "ranks (mpiexec -n 1 --ranks 2)")
    expect_in("${err}" "--ranks 2: running on 1 MPI process (mpiexec -n 1): pass the same N to both"
              "ranks (mpiexec -n 1 --ranks 2)")
  endif()

else()
  message(FATAL_ERROR "stepfuse_bench_cli_test.cmake: unknown CASE '${CASE}'")
endif()
