# Install rules: the library, its public headers, a CMake package and a pkg-config file.
#
# A consumer then does
#   find_package(stepfuse CONFIG REQUIRED)
#   target_link_libraries(app PRIVATE stepfuse::stepfuse)
# or `pkg-config --cflags --libs stepfuse`. Both files are relocatable: the install
# prefix can be chosen at install time (`cmake --install build --prefix DIR`).
# tests/consumer_test.cmake checks all of this on every test run.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

option(STEPFUSE_INSTALL "Generate the install rules" ${PROJECT_IS_TOP_LEVEL})
if(NOT STEPFUSE_INSTALL)
  return()
endif()

set(STEPFUSE_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/stepfuse"
    CACHE STRING "Where the CMake package files go, relative to the install prefix")

# Components: stepfuse_runtime (a shared library) and stepfuse_development (headers, the
# static library, package files), so the library can be installed without the tools
# (`cmake --install build --component stepfuse_development`), as the consumer test does.
install(TARGETS stepfuse EXPORT stepfuseTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT stepfuse_development
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT stepfuse_runtime
          NAMELINK_COMPONENT stepfuse_development
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT stepfuse_runtime)
# Public headers only: the C++ API (*.hpp) and, where present, the C ABI (*.h); mpi.hpp
# and nccl.hpp only with the libraries that implement them.
set(_stepfuse_header_excludes "")
if(NOT STEPFUSE_HAVE_MPI)
  list(APPEND _stepfuse_header_excludes PATTERN "mpi.hpp" EXCLUDE)
endif()
if(NOT STEPFUSE_HAVE_NCCL)
  list(APPEND _stepfuse_header_excludes PATTERN "nccl.hpp" EXCLUDE)
endif()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/stepfuse
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  COMPONENT stepfuse_development
  FILES_MATCHING PATTERN "*.hpp" PATTERN "*.h" ${_stepfuse_header_excludes})
# The kernels' C ABI (stepfuse/device_abi.h), generated from the headers the kernels embed.
install(FILES ${PROJECT_BINARY_DIR}/generated/include/stepfuse/device_abi.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/stepfuse
  COMPONENT stepfuse_development)
install(EXPORT stepfuseTargets
  NAMESPACE stepfuse::
  FILE stepfuseTargets.cmake
  DESTINATION ${STEPFUSE_INSTALL_CMAKEDIR}
  COMPONENT stepfuse_development)
# The communicators, each (when built) in an export file of its own, which the package
# config includes when it can: stepfuse::mpi once it has found MPI, stepfuse::nccl always
# (it loads NCCL at run time) (stepfuseConfig.cmake.in).
function(stepfuse_install_optional target export)
  install(TARGETS ${target} EXPORT ${export}
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT stepfuse_development
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT stepfuse_runtime
            NAMELINK_COMPONENT stepfuse_development
    RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT stepfuse_runtime)
  install(EXPORT ${export}
    NAMESPACE stepfuse::
    FILE ${export}.cmake
    DESTINATION ${STEPFUSE_INSTALL_CMAKEDIR}
    COMPONENT stepfuse_development)
endfunction()
if(STEPFUSE_HAVE_MPI)
  stepfuse_install_optional(stepfuse_mpi stepfuseMpiTargets)
endif()
if(STEPFUSE_HAVE_NCCL)
  stepfuse_install_optional(stepfuse_nccl stepfuseNcclTargets)
endif()

# A static libstepfuse.a carries its private dependencies (Highway) to whoever links
# it, so the package config must find them; a shared library has them as DT_NEEDED.
get_target_property(_stepfuse_type stepfuse TYPE)
if(_stepfuse_type STREQUAL "STATIC_LIBRARY")
  set(STEPFUSE_STATIC ON)
else()
  set(STEPFUSE_STATIC OFF)
endif()

configure_package_config_file(
  ${CMAKE_CURRENT_LIST_DIR}/stepfuseConfig.cmake.in
  ${PROJECT_BINARY_DIR}/stepfuseConfig.cmake
  INSTALL_DESTINATION ${STEPFUSE_INSTALL_CMAKEDIR})
# 0.x releases are compatible with one another by this rule; tighten it at 1.0 if needed.
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/stepfuseConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMajorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/stepfuseConfig.cmake
  ${PROJECT_BINARY_DIR}/stepfuseConfigVersion.cmake
  DESTINATION ${STEPFUSE_INSTALL_CMAKEDIR}
  COMPONENT stepfuse_development)

# pkg-config: paths relative to the .pc file itself (${pcfiledir}), so the file is
# right whatever prefix `cmake --install --prefix` chooses. An absolute libdir or
# includedir (a distribution's packaging) is used as given.
set(_pc_libdir_from_prefix "${CMAKE_INSTALL_LIBDIR}")
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
  set(STEPFUSE_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
  set(STEPFUSE_PC_LIBDIR "${CMAKE_INSTALL_LIBDIR}")
else()
  # <prefix>/<libdir>/pkgconfig -> <prefix>: one ".." per component of libdir, plus one.
  string(REGEX REPLACE "[^/]+" ".." _pc_up "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
  set(STEPFUSE_PC_PREFIX "\${pcfiledir}/${_pc_up}")
  set(STEPFUSE_PC_LIBDIR "\${prefix}/${CMAKE_INSTALL_LIBDIR}")
endif()
if(IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  set(STEPFUSE_PC_INCLUDEDIR "${CMAKE_INSTALL_INCLUDEDIR}")
else()
  set(STEPFUSE_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
endif()
# Static: Highway must be on the consumer's link line even without --static, since
# there is no shared libstepfuse to carry it. Shared: only a static link needs it.
if(STEPFUSE_STATIC)
  set(STEPFUSE_PC_REQUIRES "Requires: libhwy")
else()
  set(STEPFUSE_PC_REQUIRES "Requires.private: libhwy")
endif()
# The LLVM CPU backend links LLVM's shared library: on the consumer's link line when
# libstepfuse is static, else only for a static link.
set(STEPFUSE_PC_LIBS "")
set(STEPFUSE_PC_LIBS_PRIVATE "")
if(STEPFUSE_HAVE_LLVM)
  set(_pc_llvm "-L${LLVM_LIBRARY_DIR} -lLLVM-${LLVM_VERSION_MAJOR}")
  if(STEPFUSE_STATIC)
    set(STEPFUSE_PC_LIBS " ${_pc_llvm}")
  else()
    set(STEPFUSE_PC_LIBS_PRIVATE "Libs.private: ${_pc_llvm}")
  endif()
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/stepfuse.pc.in ${PROJECT_BINARY_DIR}/stepfuse.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/stepfuse.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig
  COMPONENT stepfuse_development)
