"""Let the OpenMP runtime's worker threads go when decoding stops.

After each parallel region libgomp's workers spin at the pool's dock barrier for ``GOMP_SPINCOUNT``
iterations (300,000 by default, ~8-10 ms of a core here) before sleeping in the kernel, so the next decode
finds them awake. Between the tokens of a reply that is what makes decoding fast. After a reply's last token
it is a core taken from the work that follows on a 2-core machine: committing the turn, writing the state
file, the HTTP response and the next request's prompt (measured: 8.7-10.0 ms of CPU burnt in the 50 ms after
a decode, 0.08 ms after ``omp_pause_resource_all``; the next decode was not measurably slower, its pool is
re-created in microseconds).

``omp_pause_resource_all`` (OpenMP 5.0) frees the *calling* thread's pool, so it must run on the thread
that decodes (``compute.COMPUTE``). The runtime is whichever OpenMP library llama.cpp's CPU backend loaded:
found with ``RTLD_NOLOAD``, never loaded by us. Builds without OpenMP (ggml's own threadpool, Metal, most
GPU builds) have none, and ``rest`` does nothing there.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable

# libgomp (GCC), LLVM's libomp, Intel's libiomp5: the runtimes ggml's OpenMP build links against. Windows
# builds use MSVC's vcomp (OpenMP 2.0, no pause), and ctypes has no RTLD_NOLOAD there: nothing to look for.
_NAMES: tuple[str, ...] = {
    "darwin": ("libomp.dylib", "libgomp.1.dylib", "libiomp5.dylib"),
    "win32": (),
}.get(sys.platform, ("libgomp.so.1", "libomp.so.5", "libomp.so", "libiomp5.so"))

_OMP_PAUSE_SOFT = 1  # keep what the runtime needs to restart quickly; hard would drop more, for nothing


@functools.cache  # looked up once: llama.cpp's CPU backend, and its OpenMP runtime, load with llama_cpp
def _find() -> Callable[[int], int] | None:
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
    for name in _NAMES:
        try:
            fn = ctypes.CDLL(name, mode=mode).omp_pause_resource_all
        except (OSError, AttributeError):  # not loaded in this process, or older than OpenMP 5.0
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    return None


def runtime_found() -> bool:
    """Whether an OpenMP runtime with ``omp_pause_resource_all`` is loaded in this process."""
    return _find() is not None


def rest() -> None:
    """Free the calling thread's OpenMP worker pool; the next parallel region starts a new one."""
    pause = _find()
    if pause is not None:
        pause(_OMP_PAUSE_SOFT)  # nonzero only inside a parallel region, which a caller between decodes is not
