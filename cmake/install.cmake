# Installation: the library, its public headers and a CMake package, so that a consumer's
# find_package(metrale CONFIG) gives it the target metrale::metrale.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS metrale EXPORT metraleTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
# The public API, header by header: what is not listed here is internal, whatever folder it is
# in. Kernel internals (src/kernels/: the argument block, the tile math) are never installed.
# host_module.h, kernel_args.h and call_site.h are public because backend.h, ledger.h and
# cpu_backend.h expose them. scripts/check-layering.sh fails when a header under
# include/metrale/ is missing here or an installed header includes an internal one, and the
# install test (tests/install/run.cmake) builds a consumer against this list alone.
set(METRALE_PUBLIC_HEADERS
  include/metrale/backend.h
  include/metrale/call_site.h
  include/metrale/checkpoint_layers.h
  include/metrale/communicator.h
  include/metrale/cpu_backend.h
  include/metrale/dense_gemm.h
  include/metrale/e4m3_block.h
  include/metrale/error.h
  include/metrale/foreign_stream.h
  include/metrale/fp8_checkpoint.h
  include/metrale/guard_bands.h
  include/metrale/handles.h
  include/metrale/host_module.h
  include/metrale/kernel_args.h
  include/metrale/lazy_buffer.h
  include/metrale/pool_stats.h
  include/metrale/stream_pool.h
  include/metrale/ledger.h
  include/metrale/model_resources.h
  include/metrale/model_scope.h
  include/metrale/modelopt.h
  include/metrale/moe_checkpoint.h
  include/metrale/numerics.h
  include/metrale/op_cache.h
  include/metrale/ops/elementwise.h
  include/metrale/ops/fp8_gemm.h
  include/metrale/ops/fp8_requant.h
  include/metrale/ops/fp8_slices.h
  include/metrale/ops/gemm.h
  include/metrale/ops/grouped_fp8.h
  include/metrale/ops/grouped_gemm.h
  include/metrale/ops/moe.h
  include/metrale/ops/parallel_linear.h
  include/metrale/ops/quant_weights.h
  include/metrale/quant.h
  include/metrale/quant_config.h
  include/metrale/runtime.h
  include/metrale/safetensors.h
  include/metrale/sharded_checkpoint.h
  include/metrale/weights.h
)
foreach(header IN LISTS METRALE_PUBLIC_HEADERS)
  get_filename_component(dir ${header} DIRECTORY)
  string(REGEX REPLACE "^include/?" "" dir "${dir}")
  install(FILES ${header} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/${dir})
endforeach()
if(TARGET metrale-cli)
  install(TARGETS metrale-cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(EXPORT metraleTargets NAMESPACE metrale:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/metrale)

configure_package_config_file(cmake/metraleConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/metraleConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/metrale)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/metraleConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/metraleConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/metraleConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/metrale)
