#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` and `llama-batched-bench` from the llama.cpp source
# vendored in the llama-cpp-python sdist of the exact version ferrum pins in pyproject.toml,
# so the benchmark compares ferrum against the same llama.cpp revision it links.
# `llama-batched-bench` is llama.cpp's own batched decode loop (no HTTP, no sampling): the
# ceiling `ferrum bench --workloads engine` measures ferrum's engine against.
#
# Two flavors (FLAVOR):
#   same     (default) the kernels of ferrum's own build: scripts/cpu-cmake-args (this
#            machine's vector extensions, AMX never), or FERRUM_CMAKE_ARGS where that is set,
#            exactly as scripts/install builds llama-cpp-python. Same kernels, fair comparison.
#   default  cmake's defaults (GGML_NATIVE=ON: -march=native, AMX included where the CPU
#            reports it): llama-server as its users build it. On AMX hosts in a VM it may die
#            in its first decode (see scripts/cpu-cmake-args); the benchmark then reports the
#            arm as failed with its log.
#
# Everything lands in a cache folder outside the repo:
#   ${FERRUM_BENCH_CACHE:-$HOME/.cache/ferrum-bench}/
#     sdist/llama_cpp_python-VERSION.tar.gz   downloaded sdist
#     src/llama_cpp_python-VERSION/            unpacked sdist
#     build-VERSION/bin/llama-server           the server, flavor same (path printed last)
#     build-VERSION/bin/llama-batched-bench    the batched decode benchmark, same flags
#     build-VERSION-default/bin/...            flavor default
#
# Idempotent: each step is skipped when its output already exists (configure re-runs only
# when the cmake arguments change); the build step is an incremental no-op when up to date.
# CPU-only Release build, no network at build time (no UI download, no HTTPS).
#
# Usage: bench/build_llama_server.sh
#   env: FERRUM_BENCH_CACHE, JOBS (default nproc), PYTHON (pip to use),
#        FLAVOR (same | default), EXTRA_CMAKE_ARGS (appended to the cmake configure line)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${FERRUM_BENCH_CACHE:-$HOME/.cache/ferrum-bench}"
jobs="${JOBS:-$(nproc)}"

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$repo_root/.venv/bin/python" ]]; then PYTHON="$repo_root/.venv/bin/python"; else PYTHON=python3; fi
fi

version="$(grep -oE 'llama-cpp-python==[0-9][0-9A-Za-z.]*' "$repo_root/pyproject.toml" | head -n1 | cut -d= -f3)"
if [[ -z "$version" ]]; then
    echo "error: no 'llama-cpp-python==X' pin found in $repo_root/pyproject.toml" >&2
    exit 1
fi

sdist_dir="$cache/sdist"
src_root="$cache/src"
src_dir="$src_root/llama_cpp_python-$version"
llama_dir="$src_dir/vendor/llama.cpp"
flavor="${FLAVOR:-same}"
case "$flavor" in
    same) build_dir="$cache/build-$version" ;;
    default) build_dir="$cache/build-$version-default" ;;
    *) echo "error: FLAVOR must be same or default, not '$flavor'" >&2; exit 1 ;;
esac
binary="$build_dir/bin/llama-server"
targets=(llama-server llama-batched-bench)

log() { echo "[build_llama_server] $*" >&2; }

sdist_path() {
    # Older sdists are named llama-cpp-python-X.tar.gz, newer (PEP 625) llama_cpp_python-X.
    compgen -G "$sdist_dir/llama[-_]cpp[-_]python-$version.tar.gz" | head -n1 || true
}

download_sdist() {
    if [[ -n "$(sdist_path)" ]]; then
        log "sdist already downloaded: $(sdist_path)"
        return
    fi
    mkdir -p "$sdist_dir"
    log "downloading llama-cpp-python==$version sdist"
    "$PYTHON" -m pip download --no-deps --no-binary :all: --dest "$sdist_dir" \
        "llama-cpp-python==$version" >&2
}

unpack_sdist() {
    if [[ -f "$llama_dir/CMakeLists.txt" ]]; then
        log "sdist already unpacked: $src_dir"
        return
    fi
    mkdir -p "$src_root"
    log "unpacking into $src_root"
    tar -xzf "$(sdist_path)" -C "$src_root"
    # The top folder's spelling follows the archive name; normalise it.
    if [[ ! -d "$src_dir" && -d "$src_root/llama-cpp-python-$version" ]]; then
        mv "$src_root/llama-cpp-python-$version" "$src_dir"
    fi
}

kernel_args() {
    if [[ "$flavor" == default ]]; then
        return  # cmake's defaults
    fi
    # The flags scripts/install gives llama-cpp-python, one per line: split as a shell would
    # (xargs keeps a quoted word whole: the native build's C/C++ flags hold spaces).
    xargs printf '%s\n' <<<"${FERRUM_CMAKE_ARGS:-$("$repo_root/scripts/cpu-cmake-args")}"
}

cmake_args() {
    # LLAMA_CURL is deprecated/ignored in this llama.cpp; the network-touching knobs are the
    # prebuilt web-UI download and OpenSSL, both switched off.
    printf '%s\n' \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        -DGGML_CCACHE=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_BORINGSSL=OFF \
        -DLLAMA_BUILD_LIBRESSL=OFF
    kernel_args
    if [[ -n "${EXTRA_CMAKE_ARGS:-}" ]]; then
        # shellcheck disable=SC2086
        printf '%s\n' $EXTRA_CMAKE_ARGS
    fi
}

configure() {
    local stamp="$build_dir/.ferrum-cmake-args" wanted
    wanted="$(cmake_args)"
    if [[ -f "$build_dir/CMakeCache.txt" && -f "$stamp" && "$(cat "$stamp")" == "$wanted" ]]; then
        log "already configured: $build_dir"
        return
    fi
    # Start from an empty cache: options derived from others (GGML_AVX* from GGML_NATIVE)
    # would otherwise keep their old cached values. Object files stay for incremental builds.
    rm -f "$build_dir/CMakeCache.txt"
    local generator=()
    if command -v ninja >/dev/null; then generator=(-G Ninja); fi
    log "configuring (Release, CPU only, offline)"
    local args
    mapfile -t args <<<"$wanted"
    cmake -S "$llama_dir" -B "$build_dir" "${generator[@]}" "${args[@]}" >&2
    echo "$wanted" >"$stamp"
}

build() {
    if [[ -x "$binary" && -x "$build_dir/bin/llama-batched-bench" ]]; then
        log "binaries present; running an incremental build check"
    else
        log "building ${targets[*]} with $jobs jobs"
    fi
    local start=$SECONDS
    # One configure, one set of GGML flags, both targets: the tools share ggml and libllama.
    cmake --build "$build_dir" --config Release --target "${targets[@]}" -j "$jobs" >&2
    log "build step took $((SECONDS - start)) s"
}

download_sdist
unpack_sdist
configure
build
"$binary" --version >&2 2>&1 || true
echo "$binary"
