# cmake --install BUILD_DIR into WORK_DIR/prefix, then build and run the consumer project against it
# with find_package(linrope <VERSION's major.minor>), and check that a version the install does not
# satisfy (the next minor: SameMinorVersion) is refused at configure time.
#   -DBUILD_DIR= -DWORK_DIR= -DCONSUMER_DIR= -DBUILD_TYPE= -DVERSION=<project version>
# With -DPREFIX=<dir> (e.g. /usr, after installing the Debian package) nothing is installed: the
# consumer is built against what is there.
file(REMOVE_RECURSE ${WORK_DIR})
if(NOT PREFIX)
  set(PREFIX ${WORK_DIR}/prefix)
  execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${PREFIX}
                  RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "cmake --install failed: ${rc}")
  endif()
endif()
string(REGEX MATCH "^([0-9]+)\\.([0-9]+)" requested ${VERSION})
math(EXPR next_minor "${CMAKE_MATCH_2} + 1")
set(too_high ${CMAKE_MATCH_1}.${next_minor})

execute_process(COMMAND ${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${WORK_DIR}/build
                        -DCMAKE_PREFIX_PATH=${PREFIX} -DCMAKE_BUILD_TYPE=${BUILD_TYPE}
                        -DLINROPE_REQUESTED_VERSION=${requested}
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring the consumer against the install (find_package(linrope "
                      "${requested})) failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the consumer failed: ${rc}")
endif()
execute_process(COMMAND ${WORK_DIR}/build/consumer RESULT_VARIABLE rc OUTPUT_VARIABLE out)
message(STATUS "${out}")
if(rc)
  message(FATAL_ERROR "the consumer failed: ${rc}")
endif()
if(NOT out MATCHES "linrope ${VERSION},")
  message(FATAL_ERROR "the consumer's <linrope/version.hpp> does not say ${VERSION}: ${out}")
endif()

execute_process(COMMAND ${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${WORK_DIR}/too_high
                        -DCMAKE_PREFIX_PATH=${PREFIX} -DLINROPE_REQUESTED_VERSION=${too_high}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc)
  message(FATAL_ERROR "find_package(linrope ${too_high}) accepted linrope ${VERSION}")
endif()
if(NOT err MATCHES "compatible with requested version \"${too_high}\"")
  message(FATAL_ERROR "find_package(linrope ${too_high}) failed, but not on the version:\n${err}")
endif()
message(STATUS "find_package(linrope ${too_high}) refused linrope ${VERSION}, as it should")
