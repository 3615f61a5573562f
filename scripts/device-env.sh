# Source on the GPU machine after ../shared/device's env.sh, for the full build (server included):
#   source .devdeps/env.sh && source scripts/device-env.sh && \
#     cmake -S . -B build-gpu -G Ninja $VLMGRAPH_CMAKE_ARGS && cmake --build build-gpu
# Fetch the extra Debian packages into .devdeps first (here, once):
#   ../shared/device/fetch-debs.sh libstb-dev libstb0 libboost1.74-dev \
#     libpng-dev libpng16-16 libjpeg62-turbo-dev libjpeg62-turbo
# What it adds, as found on that machine (2026-11-21): unpacks debs fetched after the sysroot was
# first made, puts the sysroot's headers on the compiler's path (stb, Boost, libpng, libjpeg-turbo;
# the multiarch folder too, for libjpeg's jconfig.h), lets pkg-config look there, and
# points gRPC's CMake config at the carried c-ares. The model/engine build with these settings,
# less libpng and libjpeg-turbo, ran there; with them, and the full server build, not yet.
SR=/tmp/vlmgraph-sysroot
for f in .devdeps/debs/*.deb; do
  stamp="$SR/.unpacked-$(basename "$f")"
  [ -e "$stamp" ] || { dpkg -x "$f" "$SR" && touch "$stamp"; }
done
export CPLUS_INCLUDE_PATH="$SR/usr/include:$SR/usr/include/x86_64-linux-gnu${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
export PKG_CONFIG_PATH="$SR/usr/lib/x86_64-linux-gnu/pkgconfig"
export PKG_CONFIG_SYSROOT_DIR="$SR"
export VLMGRAPH_CMAKE_ARGS="${VLMGRAPH_CMAKE_ARGS:-} -Dc-ares_INCLUDE_DIR=$SR/usr/include -Dc-ares_LIBRARY=$SR/usr/lib/x86_64-linux-gnu/libcares.so"
