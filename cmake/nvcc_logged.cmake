# cmake -DLOG=<file> -P nvcc_logged.cmake -- <nvcc command...>
# Runs one module's nvcc command and writes everything it printed to LOG in the build tree: the
# -Xptxas -v report (registers, stack and spills of every entry, hundreds of lines) belongs
# there, not on the terminal of a normal build. On failure the whole output is printed; on
# success only what is not that report (a compiler warning, say) reaches the terminal.
set(cmd "")
set(seen_dashes FALSE)
foreach(i RANGE 1 ${CMAKE_ARGC})
  if(i EQUAL CMAKE_ARGC)
    break()
  endif()
  if(seen_dashes)
    list(APPEND cmd "${CMAKE_ARGV${i}}")
  elseif(CMAKE_ARGV${i} STREQUAL "--")
    set(seen_dashes TRUE)
  endif()
endforeach()
if(NOT LOG OR NOT cmd)
  message(FATAL_ERROR "usage: cmake -DLOG=<file> -P nvcc_logged.cmake -- <command...>")
endif()
execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
file(WRITE ${LOG} "${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${out}${err}nvcc failed (${rc}); its output is also in ${LOG}")
endif()
# ptxas -v lines start with "ptxas info" or, for the stack/spill figures, with four spaces.
string(REGEX REPLACE "(^|\n)(ptxas info[^\n]*|    [0-9]+ bytes stack frame[^\n]*)" "" rest
       "${out}${err}")
string(STRIP "${rest}" rest)
if(rest)
  message("${rest}")
endif()
