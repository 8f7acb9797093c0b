#!/usr/bin/env bash
# llama.cpp's own server, the peer for concurrent decoding and speculative decoding: built from the llama.cpp
# sources inside the llama-cpp-python 0.3.36 sdist (the version the rest of the benchmarks measure), for this
# CPU. 20-55 minutes on two cores; keep it out of CI.
#
#   tools/llama_server.sh DIR             builds DIR/llama-server (DIR/src holds the sources)
#   tools/llama_server.sh DIR --avx2      the same without AVX-512, for the AVX2 machine kind emulated here
#
# Then: kvsession bench --concurrency --llama-server DIR/llama-server
set -euo pipefail
dir="${1:?usage: tools/llama_server.sh DIR [--avx2]}"
isa=(-DGGML_NATIVE=ON)
if [ "${2:-}" = "--avx2" ]; then
    isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF)
fi
mkdir -p "$dir/src"
dir="$(cd "$dir" && pwd)"
if [ ! -d "$dir/src/llama_cpp_python-0.3.36" ]; then
    python3 -m pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$dir/src"
    tar xzf "$dir/src/llama_cpp_python-0.3.36.tar.gz" -C "$dir/src"
fi
cd "$dir/src/llama_cpp_python-0.3.36/vendor/llama.cpp"
cmake -B build "${isa[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release
cmake --build build --target llama-server -j"$(nproc)"
ln -sf "$PWD/build/bin/llama-server" "$dir/llama-server"  # its libraries stay beside it, in build/bin
echo "$dir/llama-server"
