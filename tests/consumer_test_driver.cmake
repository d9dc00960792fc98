# Consumer test driver (cmake -P): builds and runs tests/consumer against this build.
#
#   MODE=install (default): ensure the library is built, `cmake --install` its
#     components into WORK_DIR/prefix, configure tests/consumer with CMAKE_PREFIX_PATH=that prefix
#     (find_package(stepfuse CONFIG)), build it, run it; then compile the same program
#     with the flags `pkg-config --cflags --libs stepfuse` gives, and run that too.
#   MODE=subdirectory: configure tests/consumer with add_subdirectory(SOURCE_DIR).
#
# Inputs (-D): MODE, SOURCE_DIR, BINARY_DIR, CONFIG, WORK_DIR, GENERATOR, C_COMPILER,
# CXX_COMPILER, SANITIZE_FLAGS (compile+link flags the library was built with, so the
# consumer links the same sanitizer runtime), PKG_CONFIG (optional).
# Registered by tests/consumer_test.cmake.
cmake_minimum_required(VERSION 3.20)

foreach(var SOURCE_DIR BINARY_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "consumer test: -D${var}=... is required")
  endif()
endforeach()
if(NOT MODE)
  set(MODE install)
endif()
if(NOT CONFIG)
  set(CONFIG Release)
endif()
cmake_host_system_information(RESULT jobs QUERY NUMBER_OF_LOGICAL_CORES)

# Runs a command, echoing it; stops the test with its output when it fails.
function(run_step what)
  string(REPLACE ";" " " shown "${ARGN}")
  message(STATUS "consumer test: ${what}: ${shown}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test: ${what} failed (${rc}):\n${out}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

function(run_consumer exe)
  run_step("run ${exe}" ${exe})
  message(STATUS "${step_output}")
  if(NOT step_output MATCHES "consumer OK")
    message(FATAL_ERROR "consumer test: ${exe} did not report success")
  endif()
endfunction()

set(consumer_src "${SOURCE_DIR}/tests/consumer")
set(prefix "${WORK_DIR}/prefix")
set(consumer_build "${WORK_DIR}/build-${MODE}")
file(REMOVE_RECURSE "${consumer_build}")
set(configure_args
  -S "${consumer_src}" -B "${consumer_build}" -G "${GENERATOR}"
  "-DCMAKE_BUILD_TYPE=${CONFIG}"
  "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
  "-DCMAKE_CXX_FLAGS=${SANITIZE_FLAGS}"
  "-DCMAKE_EXE_LINKER_FLAGS=${SANITIZE_FLAGS}"
  "-DCMAKE_SHARED_LINKER_FLAGS=${SANITIZE_FLAGS}")
if(C_COMPILER)
  list(APPEND configure_args "-DCMAKE_C_COMPILER=${C_COMPILER}")
endif()

if(MODE STREQUAL "install")
  # The test depends on the library being built: bring it up to date (a no-op normally).
  run_step("build the library" "${CMAKE_COMMAND}" --build "${BINARY_DIR}" --target stepfuse
           --config "${CONFIG}" --parallel ${jobs})
  file(REMOVE_RECURSE "${prefix}")
  # The library's components only: the tools (stepfuse-bench) need not be built for this.
  foreach(component stepfuse_runtime stepfuse_development)
    run_step("install ${component}" "${CMAKE_COMMAND}" --install "${BINARY_DIR}" --prefix "${prefix}"
             --config "${CONFIG}" --component ${component})
  endforeach()

  # What a user's build sees.
  file(GLOB_RECURSE config_file "${prefix}/*/stepfuseConfig.cmake")
  file(GLOB_RECURSE version_file "${prefix}/*/stepfuseConfigVersion.cmake")
  file(GLOB_RECURSE pc_file "${prefix}/*/pkgconfig/stepfuse.pc")
  file(GLOB_RECURSE private_headers "${prefix}/include/*.cpp" "${prefix}/include/*-inl.h")
  foreach(f "${prefix}/include/stepfuse/stepfuse.hpp" "${prefix}/include/stepfuse/version.hpp")
    if(NOT EXISTS "${f}")
      message(FATAL_ERROR "consumer test: ${f} was not installed")
    endif()
  endforeach()
  if(NOT config_file OR NOT version_file OR NOT pc_file)
    message(FATAL_ERROR "consumer test: missing package files (config '${config_file}', "
                        "version '${version_file}', pkg-config '${pc_file}')")
  endif()
  if(private_headers)
    message(FATAL_ERROR "consumer test: private files were installed: ${private_headers}")
  endif()

  run_step("configure the consumer (find_package)" "${CMAKE_COMMAND}" ${configure_args}
           "-DCMAKE_PREFIX_PATH=${prefix}"
           # Only the package just installed may satisfy find_package.
           -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
  # It must have found this prefix, not some other installed stepfuse.
  file(STRINGS "${consumer_build}/CMakeCache.txt" found_dir REGEX "^stepfuse_DIR:")
  string(REGEX REPLACE "^stepfuse_DIR:[A-Z]+=" "" found_dir "${found_dir}")
  file(REAL_PATH "${found_dir}" found_dir)
  file(REAL_PATH "${prefix}" real_prefix)
  string(FIND "${found_dir}" "${real_prefix}/" at)
  if(NOT at EQUAL 0)
    message(FATAL_ERROR "consumer test: found stepfuse in '${found_dir}', not in '${real_prefix}'")
  endif()
elseif(MODE STREQUAL "subdirectory")
  # This compiles the library again. Unoptimized, without debug information and for
  # Highway's static target only (not the five it dispatches between), that takes a third
  # of the time; the CMake logic under test depends on none of them.
  list(TRANSFORM configure_args REPLACE "^-DCMAKE_BUILD_TYPE=.*" "-DCMAKE_BUILD_TYPE=Debug")
  list(TRANSFORM configure_args REPLACE "^-DCMAKE_CXX_FLAGS=(.*)" "-DCMAKE_CXX_FLAGS=\\1 -DHWY_COMPILE_ONLY_STATIC=1")
  set(CONFIG Debug)
  run_step("configure the consumer (add_subdirectory)" "${CMAKE_COMMAND}" ${configure_args}
           "-DCMAKE_C_FLAGS_DEBUG=-O0" "-DCMAKE_CXX_FLAGS_DEBUG=-O0" "-DSTEPFUSE_SOURCE_DIR=${SOURCE_DIR}")
else()
  message(FATAL_ERROR "consumer test: unknown MODE '${MODE}'")
endif()

run_step("build the consumer" "${CMAKE_COMMAND}" --build "${consumer_build}" --config "${CONFIG}"
         --parallel ${jobs})
foreach(exe stepfuse_consumer stepfuse_nccl_consumer)
  if(EXISTS "${consumer_build}/${exe}")
    run_consumer("${consumer_build}/${exe}")
  elseif(EXISTS "${consumer_build}/${CONFIG}/${exe}")
    run_consumer("${consumer_build}/${CONFIG}/${exe}")
  elseif(exe STREQUAL "stepfuse_consumer" OR HAVE_NCCL)
    message(FATAL_ERROR "consumer test: ${exe} was not built")
  endif()
endforeach()

# pkg-config: compile the same program by hand with the flags the .pc file gives.
if(MODE STREQUAL "install")
  if(NOT PKG_CONFIG)
    message(STATUS "consumer test: no pkg-config, stepfuse.pc not checked")
    return()
  endif()
  get_filename_component(pc_dir "${pc_file}" DIRECTORY)
  set(ENV{PKG_CONFIG_PATH} "${pc_dir}")
  run_step("pkg-config" "${PKG_CONFIG}" --cflags --libs stepfuse)
  string(STRIP "${step_output}" pc_flags)
  separate_arguments(pc_flags UNIX_COMMAND "${pc_flags}")
  separate_arguments(san_flags UNIX_COMMAND "${SANITIZE_FLAGS}")
  # Its include directory must be this prefix's (the .pc file is relocatable).
  set(pc_include "")
  foreach(flag IN LISTS pc_flags)
    if(flag MATCHES "^-I(.*)")
      file(REAL_PATH "${CMAKE_MATCH_1}" dir)
      if(dir STREQUAL "${real_prefix}/include")
        set(pc_include "${dir}")
      endif()
    endif()
  endforeach()
  if(NOT pc_include)
    message(FATAL_ERROR "consumer test: stepfuse.pc does not point into ${real_prefix}: ${pc_flags}")
  endif()
  # A shared libstepfuse.so is found at run time through an rpath, as a user would set one.
  run_step("pkg-config libdir" "${PKG_CONFIG}" --variable=libdir stepfuse)
  string(STRIP "${step_output}" pc_libdir)
  run_step("compile with pkg-config flags" "${CXX_COMPILER}" -std=c++20 ${san_flags}
           "${consumer_src}/main.cpp" -o "${consumer_build}/stepfuse_consumer_pc" ${pc_flags}
           "-Wl,-rpath,${pc_libdir}")
  run_consumer("${consumer_build}/stepfuse_consumer_pc")
endif()
