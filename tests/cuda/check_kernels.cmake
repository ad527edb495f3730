# cmake -DLOGS=<a.ptxas.log;...> -DARCHS=<sm_80;...> -P check_kernels.cmake
# Reads the -Xptxas -v report the build wrote for each embedded module (cmake/nvcc_logged.cmake)
# and fails when any entry spills registers, when ptxas says it serialized an entry's wgmma
# pipeline or patched it with a wait or fence of its own (below), when a log is missing, or when
# a log has no entry for one of ARCHS (so a build that stopped reporting cannot pass). Reading the
# build's own report checks the code that ships, with its flags, and costs no second compile.
# Run by ctest (cuda.kernels_do_not_spill); the planted reports beside this file show that each
# finding fails it (cuda.kernels_do_not_spill_planted, cuda.kernels_wgmma_not_serialized_planted).
#
# A serialized wgmma pipeline still computes the right numbers, so only ptxas's advisory tells:
# each wgmma then waits for the one before, which costs the sm_90a kernels their overlap. ptxas
# (13.0) prints a line per function and reason, "(C75nn) Potential Performance Loss: wgmma.mma_async
# instructions are serialized due to <reason> in the function '<name>'", as `ptxas info` (it is
# printed without -v too, and nvcc_logged.cmake keeps it off the terminal with the report). The
# codes seen: C7509 extern calls, C7510 the pipeline crossing a call, C7511 register pressure,
# C7513 input (RS A) registers written in flight, C7514 accumulators read in flight, C7515
# accumulators written in flight, C7520 a compiler-inserted arrive on a divergent path. ptxas has
# more reasons than these (ill-formed pipeline stage, register pressure in the function, WG.DP on
# a divergent path), so the wording counts as much as the codes. C7517 and C7519, "warpgroup.wait
# (arrive) is injected ... by compiler", say ptxas added a wait for (or a fence before) a wgmma
# that the kernel's own code did not: the pipeline the source spells out is not the one that runs.
# ptxas prints these lines when its run for a target starts, before the run's "Compiling entry
# function" lines, so a finding takes the target of the entry that follows it.
if(NOT LOGS OR NOT ARCHS)
  message(FATAL_ERROR "usage: cmake -DLOGS=<logs> -DARCHS=<archs> -P check_kernels.cmake")
endif()
set(serialized_codes "C7509|C7510|C7511|C7513|C7514|C7515|C7520")
set(injected_codes "C7517|C7519")
set(report "")
set(failures "")
foreach(log IN LISTS LOGS)
  if(NOT EXISTS "${log}")
    message(FATAL_ERROR "no ptxas report at ${log}: build the library first")
  endif()
  file(STRINGS "${log}" lines)
  set(entry "")
  set(counted "")
  # This ptxas run's wgmma findings, each with @TARGET@ until the next entry names the target.
  set(pending "")
  foreach(line IN LISTS lines)
    if(line MATCHES "Compiling entry function '([^']+)' for '([^']+)'")
      set(entry "${CMAKE_MATCH_1} (${CMAKE_MATCH_2})")
      list(APPEND counted "${CMAKE_MATCH_2}")
      string(REPLACE "@TARGET@" "${CMAKE_MATCH_2}" pending "${pending}")
      string(APPEND failures "${pending}")
      set(pending "")
    elseif(line MATCHES "([0-9]+) bytes spill stores, ([0-9]+) bytes spill loads")
      if(NOT CMAKE_MATCH_1 EQUAL 0 OR NOT CMAKE_MATCH_2 EQUAL 0)
        string(STRIP "${line}" line)
        string(APPEND failures "${log}: ${entry} spills registers: ${line}\n")
      endif()
    elseif(line MATCHES "^ptxas")
      # Only ptxas's own lines: a source path or a compiler warning may say wgmma too.
      set(finding "")
      if(line MATCHES "\\((${serialized_codes})\\)"
         OR (line MATCHES "[Ww][Gg][Mm][Mm][Aa]" AND line MATCHES "[Ss]eriali[sz]"))
        set(finding "has its wgmma pipeline serialized")
      elseif(line MATCHES "\\((${injected_codes})\\)"
             OR line MATCHES "[Ww]arpgroup\\.(wait|arrive) is injected")
        set(finding "has a wgmma wait or fence injected by ptxas")
      endif()
      if(finding)
        set(function "(function not named)")
        if(line MATCHES "function '([^']+)'")
          set(function "${CMAKE_MATCH_1}")
        endif()
        string(STRIP "${line}" line)
        string(APPEND pending "${log}: ${function} (@TARGET@) ${finding}: ${line}\n")
      endif()
    endif()
  endforeach()
  # Findings after the last entry (not where ptxas puts them) still fail, without a target.
  string(REPLACE "@TARGET@" "target unknown" pending "${pending}")
  string(APPEND failures "${pending}")
  foreach(arch IN LISTS ARCHS)
    set(n 0)
    foreach(a IN LISTS counted)
      if(a STREQUAL arch)
        math(EXPR n "${n} + 1")
      endif()
    endforeach()
    if(n EQUAL 0)
      string(APPEND failures "${log}: no entry was compiled for ${arch}\n")
    endif()
    string(APPEND report "${log} ${arch}: ${n} entries\n")
  endforeach()
endforeach()
if(failures)
  # Printed as they are (FATAL_ERROR's text is re-wrapped at a width that depends on the paths),
  # then a short failure.
  message("${failures}")
  message(FATAL_ERROR "an embedded module's ptxas report fails the check (above)")
endif()
message("${report}no entry spills; ptxas neither serialized nor patched a wgmma pipeline")
