# cuda.fatbin_offline: reads the built fatbins with cuobjdump, no GPU needed (what it checks is
# in fatbin_test.cpp; the occupancy rules that blocks per SM are checked by, in
# occupancy_test.cpp). Included by tests/CMakeLists.txt inside if(METRALE_WITH_CUDA).
#
# The toolkit here ships neither cuobjdump nor nvdisasm: scripts/install-deps.sh installs them
# from NVIDIA's PyPI wheels under <site-packages>/nvidia/<cuXX>/bin, so ask python3 where that is.
execute_process(
  COMMAND python3 -c "import nvidia, os; p = list(nvidia.__path__)[0]; print(';'.join(os.path.join(p, d, 'bin') for d in sorted(os.listdir(p))))"
  OUTPUT_VARIABLE metrale_nvidia_wheel_bins OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
find_program(METRALE_CUOBJDUMP cuobjdump HINTS ${metrale_nvidia_wheel_bins} ${CUDAToolkit_BIN_DIR})
find_program(METRALE_NVDISASM nvdisasm HINTS ${metrale_nvidia_wheel_bins} ${CUDAToolkit_BIN_DIR})

# Missing tools never drop the test: it is still built and registered, and fails with the fix.
set(fatbin_offline_cuobjdump "${METRALE_CUOBJDUMP}")
set(fatbin_offline_nvdisasm "${METRALE_NVDISASM}")
if(NOT METRALE_CUOBJDUMP OR NOT METRALE_NVDISASM)
  message(WARNING "cuobjdump or nvdisasm not found: cuda.fatbin_offline will fail until "
    "scripts/install-deps.sh is run and cmake is re-run")
  if(NOT METRALE_CUOBJDUMP)
    set(fatbin_offline_cuobjdump "")
  endif()
  if(NOT METRALE_NVDISASM)
    set(fatbin_offline_nvdisasm "")
  endif()
endif()

# Not linked to metrale (the test reads no library code), but built after it, so the fatbins the
# library embeds are fresh when the test runs.
add_executable(fatbin_offline_test ${CMAKE_CURRENT_LIST_DIR}/fatbin_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/occupancy.cpp ${CMAKE_CURRENT_LIST_DIR}/occupancy_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/shell.cpp)
target_include_directories(fatbin_offline_test PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(fatbin_offline_test PRIVATE fmt::fmt GTest::gtest GTest::gtest_main)
target_compile_features(fatbin_offline_test PRIVATE cxx_std_20)
target_compile_definitions(fatbin_offline_test PRIVATE
  METRALE_CUOBJDUMP="${fatbin_offline_cuobjdump}"
  METRALE_NVDISASM="${fatbin_offline_nvdisasm}"
  METRALE_CORE_FATBIN="${PROJECT_BINARY_DIR}/src/kernels/core.fatbin"
  METRALE_W4A16_FATBIN="${PROJECT_BINARY_DIR}/src/kernels/w4a16.fatbin"
  METRALE_FP8_FATBIN="${PROJECT_BINARY_DIR}/src/kernels/fp8.fatbin"
  METRALE_MOE_FATBIN="${PROJECT_BINARY_DIR}/src/kernels/moe.fatbin")
metrale_warnings(fatbin_offline_test)
add_dependencies(fatbin_offline_test metrale)

add_test(NAME cuda.fatbin_offline COMMAND fatbin_offline_test)
set_tests_properties(cuda.fatbin_offline PROPERTIES LABELS cuda TIMEOUT 300)

# cuda.fatbin_offline.sass_budget: the decode kernel's per-weight instruction budget, counted in
# its sm_90a SASS (sass_budget_test.cpp). Its name starts with cuda.fatbin_offline so that every
# rule for that test (a carried build skips it in scripts/device-check.sh) covers it too.
add_executable(sass_budget_test ${CMAKE_CURRENT_LIST_DIR}/sass_budget_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/sass_test.cpp ${CMAKE_CURRENT_LIST_DIR}/sass.cpp
  ${CMAKE_CURRENT_LIST_DIR}/shell.cpp)
target_link_libraries(sass_budget_test PRIVATE fmt::fmt GTest::gtest GTest::gtest_main)
target_compile_features(sass_budget_test PRIVATE cxx_std_20)
target_compile_definitions(sass_budget_test PRIVATE
  METRALE_CUOBJDUMP="${fatbin_offline_cuobjdump}"
  METRALE_NVDISASM="${fatbin_offline_nvdisasm}"
  METRALE_W4A16_FATBIN="${PROJECT_BINARY_DIR}/src/kernels/w4a16.fatbin"
  METRALE_FP8_FATBIN="${PROJECT_BINARY_DIR}/src/kernels/fp8.fatbin")
metrale_warnings(sass_budget_test)
add_dependencies(sass_budget_test metrale)

# The budget on gemm_decode_packed; METRALE_SASS_BUDGET_KERNEL=gemm_decode in the environment of
# a direct run shows today's kernel failing it. The reader's cases, and today's kernel seen over
# budget, are a test of their own, so that they pass while the budget fails.
add_test(NAME cuda.fatbin_offline.sass_budget COMMAND sass_budget_test
  --gtest_filter=SassBudget.DecodeLoopsMeetTheBudget)
add_test(NAME cuda.fatbin_offline.sass_reader COMMAND sass_budget_test
  --gtest_filter=SassReader.*:SassBudget.TodaysDecodeIsOverBudget)
# gemm_fused's wgmma takes the weights from registers, unserialized; its counts per weight.
add_test(NAME cuda.fatbin_offline.sass_fused COMMAND sass_budget_test
  --gtest_filter=SassBudget.Fused*)
# gemm_int4_decode within the same decode budget, its weights counted by its zero subtractions.
add_test(NAME cuda.fatbin_offline.sass_int4 COMMAND sass_budget_test
  --gtest_filter=SassBudget.Int4DecodeLoopsMeetTheBudget)
# The grouped GEMMs' loops against their dense kernels'.
add_test(NAME cuda.fatbin_offline.sass_grouped COMMAND sass_budget_test
  --gtest_filter=SassBudget.GroupedLoopsAreTheirDenseKernels)
# The grouped W8A8 GEMM's kernels: the tiled one's FP8 wgmma loop and the decode one's FFMA
# loops, counted per one-byte weight.
add_test(NAME cuda.fatbin_offline.sass_grouped_fp8 COMMAND sass_budget_test
  --gtest_filter=SassBudget.GroupedFp8*)
set_tests_properties(cuda.fatbin_offline.sass_budget cuda.fatbin_offline.sass_reader
  cuda.fatbin_offline.sass_fused cuda.fatbin_offline.sass_int4 cuda.fatbin_offline.sass_grouped
  cuda.fatbin_offline.sass_grouped_fp8 PROPERTIES
  LABELS cuda TIMEOUT 120)
