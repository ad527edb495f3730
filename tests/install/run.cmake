# Installs the build into a fresh prefix, checks that every installed header includes only
# installed headers, standard headers and the allowed third-party ones, then configures, builds
# and runs a consumer that finds metrale with find_package(metrale CONFIG) from that prefix
# alone and compiles each installed header on its own.
cmake_minimum_required(VERSION 3.25)  # policies of this era in script mode (IN_LIST)
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  message("${out}")
endfunction()

run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})

# The C++ standard library's headers, and the third-party headers a public header may name:
# <cuda_bf16.h> only, and only under nvcc (numerics.h). Anything else an installed header
# includes must be installed itself, or the header reaches metrale's internals.
set(standard_headers
  algorithm any array atomic barrier bit bitset cassert cctype cerrno cfenv cfloat charconv
  chrono cinttypes climits clocale cmath codecvt compare complex concepts condition_variable
  coroutine csetjmp csignal cstdarg cstddef cstdint cstdio cstdlib cstring ctime cuchar cwchar
  cwctype deque exception execution expected filesystem format forward_list fstream functional
  future initializer_list iomanip ios iosfwd iostream istream iterator latch limits list locale
  map memory memory_resource mutex new numbers numeric optional ostream queue random ranges
  ratio regex scoped_allocator semaphore set shared_mutex source_location span sstream stack
  stdexcept stop_token streambuf string string_view syncstream system_error thread tuple
  type_traits typeindex typeinfo unordered_map unordered_set utility valarray variant vector
  version)
set(third_party_headers cuda_bf16.h)

file(GLOB_RECURSE installed RELATIVE ${prefix}/include ${prefix}/include/*)
if(NOT installed)
  message(FATAL_ERROR "the install put no header under ${prefix}/include")
endif()
set(bad "")
foreach(header IN LISTS installed)
  get_filename_component(dir ${prefix}/include/${header} DIRECTORY)
  file(STRINGS ${prefix}/include/${header} lines REGEX "^[ \t]*#[ \t]*include")
  foreach(line IN LISTS lines)
    if(NOT line MATCHES "^[ \t]*#[ \t]*include[ \t]*([<\"])([^>\"]+)[>\"]")
      continue()
    endif()
    set(quote "${CMAKE_MATCH_1}")
    set(target "${CMAKE_MATCH_2}")
    if(EXISTS ${prefix}/include/${target})
      continue()
    endif()
    if(quote STREQUAL "\"" AND EXISTS ${dir}/${target})
      continue()
    endif()
    if(quote STREQUAL "<" AND
       (target IN_LIST standard_headers OR target IN_LIST third_party_headers))
      continue()
    endif()
    set(close "\"")
    if(quote STREQUAL "<")
      set(close ">")
    endif()
    string(APPEND bad "\n  include/${header}: #include ${quote}${target}${close}: not installed, "
                      "and not a standard or allowed third-party header (an internal header?)")
  endforeach()
  # One translation unit per header: each installed header compiles on its own.
  string(MAKE_C_IDENTIFIER ${header} name)
  file(WRITE ${WORK_DIR}/headers/${name}.cpp "#include <${header}>\n")
endforeach()
if(bad)
  message(FATAL_ERROR "installed headers include headers outside the installed API:${bad}")
endif()
list(LENGTH installed count)
message("install: ${count} installed headers include only installed, standard or allowed headers")

run(${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${WORK_DIR}/consumer -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release -DHEADER_TU_DIR=${WORK_DIR}/headers)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/consumer)
run(${WORK_DIR}/consumer/consumer)
