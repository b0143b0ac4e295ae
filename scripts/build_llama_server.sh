#!/usr/bin/env bash
# Build llama.cpp's own tools from the llama.cpp sources shipped in the llama-cpp-python sdist, with the same
# portable flags as the library: `llama-server` (the --server backend and the serve bench's anchor), `llama-bench`
# (the decode-speed anchor) and `test-llama-archs` (llama.cpp's fixture generator: a random-weight GGUF per
# architecture, how the tests cover every memory kind). Cache the binaries outside the repository (keyed by version + flags): a rebuild
# takes ~6 minutes on 2 cores, so later runs (and every worktree, and CI on the same machine) reuse it.
#
#   ./scripts/build_llama_server.sh          # prints the binary's path on its last line
#   CHATCLI_LLAMA_SERVER_CACHE=/somewhere ./scripts/build_llama_server.sh
#
# The tests find the binary through $CHATCLI_LLAMA_SERVER, else this cache path (tests/remote_server.py
# `server_binary()` computes the same path: keep them in step).
set -euo pipefail

LLAMA_VERSION="0.3.36"
FLAVOUR="portable"
PYTHON="${PYTHON:-python3}"
CACHE_ROOT="${CHATCLI_LLAMA_SERVER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/chatcli}"
DEST="$CACHE_ROOT/llama-server-$LLAMA_VERSION-$FLAVOUR"
BIN="$DEST/bin/llama-server"

# GGML_NATIVE=OFF: a VM may advertise CPU features it cannot run (AMX → SIGILL), see scripts/setup.sh.
# No web UI (LLAMA_USE_PREBUILT_UI would fetch one at build time), no HTTPS/OpenSSL (chatcli talks plain HTTP to
# it; put TLS in front if needed), no tests/examples (build time). LLAMA_CURL is gone from this llama.cpp (its
# CMakeLists only warns "deprecated and will be ignored"), so it is not passed.
CMAKE_FLAGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DGGML_NATIVE=OFF
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_BUILD_TESTS=ON
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DBUILD_SHARED_LIBS=OFF
)

smoke() {
    # The binary must start on this CPU (not only exist): --version loads the backends and prints the build.
    "$BIN" --version >/dev/null 2>&1
}

TARGETS=(llama-server llama-bench test-llama-archs)

if [ -x "$BIN" ] && [ -x "$DEST/bin/test-llama-archs" ] && [ -x "$DEST/bin/llama-bench" ] && [ -f "$DEST/flags" ] && [ "$(cat "$DEST/flags")" = "${CMAKE_FLAGS[*]}" ] && smoke; then
    echo "llama-server (cached): $BIN"
    exit 0
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/chatcli-llama-server.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

echo "building llama-server, llama-bench and test-llama-archs from the llama-cpp-python $LLAMA_VERSION sdist (about 8 minutes on 2 cores)"
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_VERSION" -d "$WORK"
tar -xzf "$WORK"/llama_cpp_python-"$LLAMA_VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp"
[ -f "$SRC/tools/server/server.cpp" ] || { echo "no tools/server in $SRC" >&2; exit 1; }

# cmake (and ninja) from PyPI when the machine has none: llama-cpp-python's own build gets them that way too.
if ! command -v cmake >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet --target "$WORK/tools" cmake ninja
    export PATH="$WORK/tools/bin:$PATH" PYTHONPATH="$WORK/tools${PYTHONPATH:+:$PYTHONPATH}"
fi
GENERATOR=()
if command -v ninja >/dev/null 2>&1; then GENERATOR=(-G Ninja); fi
cmake -S "$SRC" -B "$WORK/build" "${GENERATOR[@]}" "${CMAKE_FLAGS[@]}" >"$WORK/cmake.log" 2>&1 \
    || { cat "$WORK/cmake.log" >&2; exit 1; }
JOBS="${CHATCLI_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}"
cmake --build "$WORK/build" --target "${TARGETS[@]}" -j "$JOBS" >"$WORK/build.log" 2>&1 \
    || { tail -50 "$WORK/build.log" >&2; exit 1; }

# Install atomically: a half-copied binary must never look like a cached one.
mkdir -p "$CACHE_ROOT"
STAGE="$(mktemp -d "$CACHE_ROOT/.stage.XXXXXX")"
mkdir -p "$STAGE/bin"
for t in "${TARGETS[@]}"; do cp "$WORK/build/bin/$t" "$STAGE/bin/$t"; done
# The chat templates llama.cpp tests itself with (tests/test_templates.py renders every one) and gguf-py (the
# fixtures' copies with a chat template set are written with it): both from the same sources as the binaries.
cp -r "$SRC/models/templates" "$STAGE/templates"
cp -r "$SRC/gguf-py" "$STAGE/gguf-py"
# Shared libraries, should a flag ever turn BUILD_SHARED_LIBS back on (the binary's rpath is $ORIGIN-relative).
find "$WORK/build/bin" -maxdepth 1 -name '*.so*' -exec cp -P {} "$STAGE/bin/" \; 2>/dev/null || true
printf '%s' "${CMAKE_FLAGS[*]}" >"$STAGE/flags"
rm -rf "$DEST"
mv "$STAGE" "$DEST"

if ! smoke; then
    echo "the llama-server build does not run on this machine:" >&2
    "$BIN" --version >&2 || true
    exit 1
fi
"$BIN" --version 2>&1 | sed 's/^/  /'
echo "llama-server: $BIN"
