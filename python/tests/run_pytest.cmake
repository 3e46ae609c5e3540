# Runs pytest on one test file: cmake -DPYTHON=... -DPYTHONPATH=... -DTESTS=<file> -P run_pytest.cmake
# pytest exits 5 when it collects no tests (a renamed test function, a module-level skip, a missing
# import turned into a skip): that would pass silently under CTest, so it fails here, saying why.
set(ENV{PYTHONPATH} ${PYTHONPATH})
# CTest runs this beside other tests on every core: with OpenMP's default spin-waiting, each kernel
# call's team then waits a scheduler timeslice for a descheduled thread (measured: 16 ms per call
# instead of 0.03 ms on this 2-core machine under load), and gradcheck makes thousands of calls.
# Passive waiting changes no result (the work's cut depends on the shapes only) and avoids it.
set(ENV{OMP_WAIT_POLICY} PASSIVE)
# -p no:cacheprovider: never write .pytest_cache into the source tree.
execute_process(COMMAND ${PYTHON} -m pytest -q -p no:cacheprovider ${TESTS}
                RESULT_VARIABLE result)
if(result EQUAL 5)
  message(FATAL_ERROR "pytest collected no tests from ${TESTS} (exit 5): every test was "
                      "deselected or the file defines none; a CTest pass needs at least one test.")
elseif(NOT result EQUAL 0)
  message(FATAL_ERROR "pytest ${TESTS} failed (exit ${result})")
endif()
