#!/usr/bin/env bash
# ik_llama.cpp's llama-server (ikawrakow's fork of llama.cpp: int8 flash attention against a Q8_0 K cache,
# rows repacked at load with -rtr), the fastest CPU peer for agent-scale contexts: built for this CPU from the
# ik_llama.cpp sources inside PyPI's ik-llama-cpp-python sdist. 20-50 minutes on two cores; keep it out of CI.
#
#   tools/ik_llama_server.sh DIR          builds DIR/llama-server (DIR/src holds the sources)
#
# Then: kvsession bench --long --ik-llama-server DIR/llama-server [--llama-server ...]
set -euo pipefail
dir="${1:?usage: tools/ik_llama_server.sh DIR}"
version=0.1.5
mkdir -p "$dir/src"
dir="$(cd "$dir" && pwd)"
if [ ! -d "$dir/src/ik_llama_cpp_python-$version" ]; then
    python3 -m pip download --no-deps --no-binary :all: "ik-llama-cpp-python==$version" -d "$dir/src"
    tar xzf "$dir/src/ik_llama_cpp_python-$version.tar.gz" -C "$dir/src"
fi
cd "$dir/src/ik_llama_cpp_python-$version/vendor/ik_llama.cpp"
# the sdist has no git repository and no common/cmake/build-info-gen-cpp.cmake, which the build runs to write
# common/build-info.cpp: write it here, newer than its template, so that the rule has nothing to do
if [ ! -f common/cmake/build-info-gen-cpp.cmake ] && [ ! -f common/build-info.cpp ]; then
    sed -e 's/@BUILD_NUMBER@/0/' -e "s/@BUILD_COMMIT@/ik-llama-cpp-python-$version/" \
        -e "s/@BUILD_COMPILER@/$(cc --version | head -1)/" -e 's/@BUILD_TARGET@/native/' \
        common/build-info.cpp.in > common/build-info.cpp
fi
cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release
cmake --build build --target llama-server -j"$(nproc)"
ln -sf "$PWD/build/bin/llama-server" "$dir/llama-server"  # its libraries stay beside it, in build/bin
echo "$dir/llama-server"
