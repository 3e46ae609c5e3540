# linrope_compiled_isa(<out var>): the instruction-set extensions the compiler may use for the
# library, read from its predefined macros (`-dM -E`) under the target's -march, as the names
# /proc/cpuinfo's "flags" line gives them (SSE3 is "pni", LZCNT "abm"). A CPU that lacks any of
# them may die of an illegal instruction in this build, which is why the Python package records
# them and checks them before it loads its module. Empty for a compiler without `-dM -E`.
function(linrope_compiled_isa out)
  set(march)
  if(LINROPE_NATIVE)
    set(march -march=native)
  endif()
  separate_arguments(cxx_flags UNIX_COMMAND "${CMAKE_CXX_FLAGS}")
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} ${cxx_flags} ${march} -dM -E -x c++ /dev/null
                  OUTPUT_VARIABLE macros RESULT_VARIABLE rc ERROR_QUIET)
  set(isa)
  if(rc EQUAL 0)
    # <macro without underscores>=<cpuinfo flag>, from the oldest extension to the newest.
    foreach(pair SSE2=sse2 SSE3=pni SSSE3=ssse3 SSE4_1=sse4_1 SSE4_2=sse4_2 POPCNT=popcnt
                 AVX=avx AVX2=avx2 FMA=fma F16C=f16c BMI=bmi1 BMI2=bmi2 LZCNT=abm MOVBE=movbe
                 AVXVNNI=avx_vnni AVX512F=avx512f AVX512CD=avx512cd AVX512BW=avx512bw
                 AVX512DQ=avx512dq AVX512VL=avx512vl AVX512IFMA=avx512ifma
                 AVX512VBMI=avx512vbmi AVX512VBMI2=avx512_vbmi2 AVX512VNNI=avx512_vnni
                 AVX512BITALG=avx512_bitalg AVX512VPOPCNTDQ=avx512_vpopcntdq
                 AVX512BF16=avx512_bf16 AVX512FP16=avx512_fp16 ARM_NEON=asimd ARM_FEATURE_SVE=sve)
      string(REPLACE "=" ";" pair ${pair})
      list(GET pair 0 macro)
      list(GET pair 1 flag)
      if(macros MATCHES "#define __${macro}__ ")
        list(APPEND isa ${flag})
      endif()
    endforeach()
  endif()
  set(${out} ${isa} PARENT_SCOPE)
endfunction()
