# Writes linrope/_build_info.py at build time (cmake -D... -P write_build_info.cmake), so that the
# commit is the one built, not the one configured. Touches the file only when its text changes.
#   OUT, SOURCE_DIR, BUILD_DIR, VERSION, BUILD_TYPE, COMPILER, NATIVE, OPENMP (ON/OFF), ISA (comma-separated)
find_package(Git QUIET)
set(commit "unknown")
set(dirty None)
if(GIT_FOUND)
  execute_process(COMMAND ${GIT_EXECUTABLE} -C ${SOURCE_DIR} rev-parse HEAD
                  OUTPUT_VARIABLE head RESULT_VARIABLE rc OUTPUT_STRIP_TRAILING_WHITESPACE
                  ERROR_QUIET)
  if(rc EQUAL 0)
    set(commit ${head})
    execute_process(COMMAND ${GIT_EXECUTABLE} -C ${SOURCE_DIR} status --porcelain
                            --untracked-files=no
                    OUTPUT_VARIABLE changes RESULT_VARIABLE rc ERROR_QUIET)
    if(rc EQUAL 0 AND changes STREQUAL "")
      set(dirty False)
    elseif(rc EQUAL 0)
      set(dirty True)
    endif()
  endif()
endif()
set(native False)
if(NATIVE)
  set(native True)
endif()
set(openmp False)
if(OPENMP)
  set(openmp True)
endif()
string(REPLACE "," " " isa_words "${ISA}")
set(text "\
# Generated at build time by cmake/write_build_info.cmake; every build rewrites it.
version = \"${VERSION}\"
git_commit = \"${commit}\"
git_dirty = ${dirty}  # tracked files differed from the commit; None: not known
build_type = \"${BUILD_TYPE}\"
compiler = \"${COMPILER}\"
build_dir = \"${BUILD_DIR}\"  # where CMake built it (setup.py's build directory for pip)
native = ${native}  # -march=native (LINROPE_NATIVE): runs only on CPUs with the ISA below
openmp = ${openmp}  # LINROPE_OPENMP
# The instruction-set extensions the compiler was allowed to use, as /proc/cpuinfo names them;
# linrope/__init__.py refuses to load the module on a CPU that lacks one of them.
isa = tuple(\"${isa_words}\".split())
")
file(WRITE ${OUT}.tmp "${text}")
file(COPY_FILE ${OUT}.tmp ${OUT} ONLY_IF_DIFFERENT)
file(REMOVE ${OUT}.tmp)
