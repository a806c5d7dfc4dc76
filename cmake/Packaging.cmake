# Debian packages (`cpack`, docs/DEPLOYING.md): estuary-server and
# estuary-client, each its binary, a hardened systemd unit, a commented config
# in /etc/estuary marked as a conffile, and maintainer scripts that create the
# estuary system user. Their Depends come from dpkg-shlibdeps.
#
# The units and configs are EXCLUDE_FROM_ALL: a plain `cmake --install
# --prefix P` installs the programs, the client API and the Python module,
# never into the host's /etc; cpack installs them component by component.

# Where the packages put the programs; the units name them there.
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(ESTUARY_PACKAGE_BINDIR ${CPACK_PACKAGING_INSTALL_PREFIX}/${CMAKE_INSTALL_BINDIR})

set(packaging ${PROJECT_SOURCE_DIR}/packaging)
foreach(component server client)
  set(ESTUARY_DEB_PACKAGE estuary-${component})
  set(ESTUARY_UNIT estuary-${component}.service)
  set(out ${PROJECT_BINARY_DIR}/packaging/${component})
  configure_file(${packaging}/${ESTUARY_UNIT}.in ${out}/${ESTUARY_UNIT} @ONLY)
  foreach(script postinst prerm postrm)
    configure_file(${packaging}/${script}.in ${out}/${script} @ONLY)
  endforeach()
  file(WRITE ${out}/conffiles "/etc/estuary/${component}.toml\n")
  # /usr/lib/systemd/system: where Debian's systemd looks for a package's units.
  install(FILES ${out}/${ESTUARY_UNIT} DESTINATION lib/systemd/system COMPONENT ${component} EXCLUDE_FROM_ALL)
  install(FILES ${packaging}/${component}.toml DESTINATION /etc/estuary COMPONENT ${component} EXCLUDE_FROM_ALL)
  string(TOUPPER ${component} C)
  set(CPACK_DEBIAN_${C}_PACKAGE_NAME estuary-${component})
  set(CPACK_DEBIAN_${C}_PACKAGE_CONTROL_EXTRA ${out}/conffiles ${out}/postinst ${out}/prerm ${out}/postrm)
  # postinst creates the user with adduser; the rest is dpkg-shlibdeps'.
  set(CPACK_DEBIAN_${C}_PACKAGE_DEPENDS adduser)
endforeach()

set(CPACK_GENERATOR DEB)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL server client)
set(CPACK_PACKAGE_VENDOR Estuary)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(ESTUARY_DEB_MAINTAINER "Estuary maintainers <estuary@example.org>" CACHE STRING "the packages' Maintainer field")
set(CPACK_DEBIAN_PACKAGE_MAINTAINER ${ESTUARY_DEB_MAINTAINER})
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEBIAN_PACKAGE_RELEASE 1)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # estuary-server_0.1.0-1_amd64.deb
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_STRIP_FILES ON)
string(CONCAT CPACK_COMPONENT_SERVER_DESCRIPTION
    "Estuary federated learning aggregation server\n"
    "Coordinates a federation's rounds over mutual TLS, aggregates the sites' updates and keeps the round log "
    "and the global models. Runs as estuary-server.service, configured in /etc/estuary/server.toml.")
string(CONCAT CPACK_COMPONENT_CLIENT_DESCRIPTION
    "Estuary federated learning site\n"
    "Joins a federation over mutual TLS, trains on this site's own data when selected and uploads only its "
    "update. Runs as estuary-client.service, configured in /etc/estuary/client.toml.")

# A CUDA build links NVIDIA's libraries (cuBLAS, the CUDA runtime, NCCL),
# which no Debian package of the build host provides: CPack runs
# dpkg-shlibdeps with --ignore-missing-info, so they are found there (-l) and
# become no dependency. A host that installs the package brings its own CUDA.
if(ESTUARY_HAVE_CUDA)
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS ${CUDAToolkit_LIBRARY_DIR})
  if(ESTUARY_NCCL_LIBRARY)
    get_filename_component(nccl_dir ${ESTUARY_NCCL_LIBRARY} DIRECTORY)
    list(APPEND CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS ${nccl_dir})
    list(REMOVE_DUPLICATES CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS)
  endif()
  string(APPEND CPACK_COMPONENT_CLIENT_DESCRIPTION
         " Built with CUDA ${CUDAToolkit_VERSION}: needs NVIDIA's driver, CUDA runtime, cuBLAS and NCCL.")
endif()

include(CPack)
