# Registers the consumer tests (label "consumer"); included from tests/CMakeLists.txt.
# Each runs tests/consumer_test_driver.cmake with this build's compiler, generator,
# configuration and sanitizer flags.
find_program(STEPFUSE_PKG_CONFIG NAMES pkgconf pkg-config)
mark_as_advanced(STEPFUSE_PKG_CONFIG)
# A sanitized library needs its runtime on the consumer's link line too: must match
# the flags of STEPFUSE_SANITIZE in the top-level CMakeLists.txt.
if(STEPFUSE_SANITIZE)
  set(_stepfuse_consumer_flags "-fsanitize=address,undefined -fno-omit-frame-pointer")
else()
  set(_stepfuse_consumer_flags "")
endif()

# MODE: install (find_package from an installed prefix, and pkg-config) or subdirectory.
function(stepfuse_add_consumer_test name mode)
  add_test(NAME ${name}
    COMMAND ${CMAKE_COMMAND}
      -DMODE=${mode}
      -DSOURCE_DIR=${PROJECT_SOURCE_DIR}
      -DBINARY_DIR=${PROJECT_BINARY_DIR}
      -DCONFIG=$<CONFIG>
      -DWORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/consumer
      -DGENERATOR=${CMAKE_GENERATOR}
      -DC_COMPILER=${CMAKE_C_COMPILER}
      -DCXX_COMPILER=${CMAKE_CXX_COMPILER}
      -DSANITIZE_FLAGS=${_stepfuse_consumer_flags}
      -DPKG_CONFIG=${STEPFUSE_PKG_CONFIG}
      -P ${CMAKE_CURRENT_LIST_DIR}/consumer_test_driver.cmake)
  set_tests_properties(${name} PROPERTIES LABELS consumer TIMEOUT 900)
endfunction()

stepfuse_add_consumer_test(consumer_find_package install)
# The same consumer with the source tree as a subdirectory. It compiles the library once
# more, so only the plain build runs it: the CMake logic it checks is the same in both.
if(NOT STEPFUSE_SANITIZE)
  stepfuse_add_consumer_test(consumer_add_subdirectory subdirectory)
endif()
