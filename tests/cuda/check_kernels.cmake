# Compiles every kernel source for each of its machine-code targets with ptxas verbose output,
# and fails when any entry spills registers. Run by ctest (cuda.kernels_do_not_spill).
file(GLOB sources ${KERNEL_DIR}/*.cu)
set(report "")
foreach(src IN LISTS sources)
  foreach(arch IN ITEMS sm_80 sm_89 sm_90a)
    execute_process(COMMAND ${NVCC} -cubin -std=c++17 -O3 -arch=${arch} -Xptxas -v
                            -I${INCLUDE_DIR} -I${INCLUDE_DIR}/../src -o /dev/null ${src}
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "nvcc failed for ${src} (${arch}):\n${err}")
    endif()
    string(REGEX MATCHALL "[0-9]+ bytes spill stores, [0-9]+ bytes spill loads" spills "${err}")
    foreach(s IN LISTS spills)
      if(NOT s MATCHES "^0 bytes spill stores, 0 bytes spill loads$")
        message(FATAL_ERROR "${src} (${arch}) spills registers: ${s}\n${err}")
      endif()
    endforeach()
    list(LENGTH spills entries)
    string(APPEND report "${src} ${arch}: ${entries} entries, no spills\n")
  endforeach()
endforeach()
message("${report}")
