# The stepfuse::mpi consumer test (cmake -P; registered by tests/mpi/CMakeLists.txt as
# mpi.consumer): brings the libraries up to date, installs this build's components into
# WORK_DIR/prefix, configures tests/mpi/consumer against that prefix with
# find_package(stepfuse COMPONENTS mpi), builds it, and runs it under mpiexec on 2 ranks.
#
# Inputs (-D): SOURCE_DIR (the consumer project), BINARY_DIR, CONFIG, WORK_DIR, GENERATOR,
# C_COMPILER, CXX_COMPILER, MPIEXEC, MPIEXEC_NUMPROC_FLAG, MPIEXEC_FLAGS (space-separated).
cmake_minimum_required(VERSION 3.20)

foreach(var SOURCE_DIR BINARY_DIR WORK_DIR GENERATOR CXX_COMPILER MPIEXEC)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "mpi consumer test: -D${var}=... is required")
  endif()
endforeach()
if(NOT CONFIG)
  set(CONFIG Release)
endif()
cmake_host_system_information(RESULT jobs QUERY NUMBER_OF_LOGICAL_CORES)

function(run_step what)
  string(REPLACE ";" " " shown "${ARGN}")
  message(STATUS "mpi consumer test: ${what}: ${shown}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "mpi consumer test: ${what} failed (${rc}):\n${out}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

set(prefix "${WORK_DIR}/prefix")
set(build "${WORK_DIR}/build")
file(REMOVE_RECURSE "${prefix}" "${build}")

run_step("build the libraries" "${CMAKE_COMMAND}" --build "${BINARY_DIR}" --target stepfuse stepfuse_mpi
         --config "${CONFIG}" --parallel ${jobs})
foreach(component stepfuse_runtime stepfuse_development)
  run_step("install ${component}" "${CMAKE_COMMAND}" --install "${BINARY_DIR}" --prefix "${prefix}"
           --config "${CONFIG}" --component ${component})
endforeach()
foreach(f include/stepfuse/mpi.hpp)
  if(NOT EXISTS "${prefix}/${f}")
    message(FATAL_ERROR "mpi consumer test: ${prefix}/${f} was not installed")
  endif()
endforeach()
file(GLOB_RECURSE mpi_targets "${prefix}/*/stepfuseMpiTargets.cmake")
if(NOT mpi_targets)
  message(FATAL_ERROR "mpi consumer test: stepfuseMpiTargets.cmake was not installed")
endif()

set(configure_args -S "${SOURCE_DIR}" -B "${build}" -G "${GENERATOR}" "-DCMAKE_BUILD_TYPE=${CONFIG}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
if(C_COMPILER)
  list(APPEND configure_args "-DCMAKE_C_COMPILER=${C_COMPILER}")
endif()
run_step("configure the consumer" "${CMAKE_COMMAND}" ${configure_args})
run_step("build the consumer" "${CMAKE_COMMAND}" --build "${build}" --config "${CONFIG}" --parallel ${jobs})

set(exe "${build}/stepfuse_mpi_consumer")
if(NOT EXISTS "${exe}")
  set(exe "${build}/${CONFIG}/stepfuse_mpi_consumer")
endif()
separate_arguments(flags UNIX_COMMAND "${MPIEXEC_FLAGS}")
run_step("run the consumer" "${MPIEXEC}" ${MPIEXEC_NUMPROC_FLAG} 2 ${flags} "${exe}")
message(STATUS "${step_output}")
if(NOT step_output MATCHES "consumer OK")
  message(FATAL_ERROR "mpi consumer test: the consumer did not report success")
endif()
