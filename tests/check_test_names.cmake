# Fails if a doctest TEST_CASE name contains ';': doctest_discover_tests builds a CMake list from the
# names, the ';' splits it, and the cut-off CTest entry then matches no test case and passes while
# running nothing.
file(GLOB_RECURSE sources ${SOURCE_DIR}/tests/*.cpp ${SOURCE_DIR}/experiments/tests/*.cpp)
set(bad "")
foreach(source ${sources})
  file(STRINGS ${source} lines REGEX "TEST_CASE\\(\"[^\"]*\\;")
  foreach(line ${lines})
    string(APPEND bad "\n  ${source}: ${line}")
  endforeach()
endforeach()
if(bad)
  message(FATAL_ERROR "test names must not contain ';' (rename with ',' or 'and'):${bad}")
endif()
