# Installation: the library, its public headers and a CMake package, so that a consumer's
# find_package(metrale CONFIG) gives it the target metrale::metrale.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS metrale EXPORT metraleTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY include/metrale DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
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
