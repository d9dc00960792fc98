# Registers the consumer tests (label "consumer"); included from tests/CMakeLists.txt.
# Each runs tests/consumer_test_driver.cmake with this build's compiler, generator and
# configuration.
find_program(STEPFUSE_PKG_CONFIG NAMES pkgconf pkg-config)
mark_as_advanced(STEPFUSE_PKG_CONFIG)
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
      -DPKG_CONFIG=${STEPFUSE_PKG_CONFIG}
      -DHAVE_NCCL=${STEPFUSE_HAVE_NCCL}
      -P ${CMAKE_CURRENT_LIST_DIR}/consumer_test_driver.cmake)
  set_tests_properties(${name} PROPERTIES LABELS consumer TIMEOUT 900)
endfunction()

# Only the plain build runs them: the CMake logic they check is the same in the sanitizer
# build, where installing and building the consumer takes minutes. The subdirectory
# consumer compiles the library once more.
if(NOT STEPFUSE_SANITIZER)
  stepfuse_add_consumer_test(consumer_find_package install)
  stepfuse_add_consumer_test(consumer_add_subdirectory subdirectory)
endif()
