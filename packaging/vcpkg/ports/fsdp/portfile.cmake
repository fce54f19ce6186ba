# vcpkg port of fsdp (an overlay port: vcpkg install fsdp --overlay-ports=packaging/vcpkg/ports).
# fsdp is header-only: the port installs fsdp's CMake install tree, with the package config in
# share/fsdp where vcpkg expects it. The CUDA toolkit's headers (with CCCL) come from the system
# (/usr/local/cuda), as for every other way in (docs/install.md).
# Its source: FSDP_SOURCE_DIR when set (the test, tests/package/check_vcpkg_port.cmake, and a
# checkout), else the release archive.
if(DEFINED ENV{FSDP_SOURCE_DIR})
  set(SOURCE_PATH "$ENV{FSDP_SOURCE_DIR}")
else()
  vcpkg_download_distfile(ARCHIVE
    URLS "https://example.invalid/fsdp/archive/v${VERSION}.tar.gz"
    FILENAME "fsdp-${VERSION}.tar.gz"
    SKIP_SHA512)
  vcpkg_extract_source_archive(SOURCE_PATH ARCHIVE "${ARCHIVE}")
endif()

vcpkg_check_features(OUT_FEATURE_OPTIONS FEATURE_OPTIONS
  FEATURES
    mpi  FSDP_MPI
    cuda FSDP_CUDA)

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    -DFSDP_BUILD_TESTS=OFF
    -DFSDP_BUILD_EXAMPLES=OFF
    -DFSDP_BUILD_BENCH=OFF
    -DFSDP_INSTALL_CMAKEDIR=share/fsdp
    ${FEATURE_OPTIONS})
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(PACKAGE_NAME fsdp CONFIG_PATH share/fsdp)

# Header-only: no debug tree.
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug" "${CURRENT_PACKAGES_DIR}/lib")
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
file(WRITE "${CURRENT_PACKAGES_DIR}/share/${PORT}/copyright" "fsdp: no license has been declared yet.\n")
