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
cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release
cmake --build build --target llama-server -j"$(nproc)"
ln -sf "$PWD/build/bin/llama-server" "$dir/llama-server"  # its libraries stay beside it, in build/bin
echo "$dir/llama-server"
