# METRALE_SANITIZE applies to everything built here, GoogleTest's mains included, so every frame
# is instrumented. Recovery is off: the first report fails the test.
if(METRALE_SANITIZE)
  set(_san "-fsanitize=${METRALE_SANITIZE}")
  add_compile_options(${_san} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  add_link_options(${_san})
  message(STATUS "metrale: sanitizers ${METRALE_SANITIZE}")
endif()
