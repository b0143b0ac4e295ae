"""A read-only GGUF header reader.

chatcli needs a model's metadata (architecture, trained context, chat template) and a cheap fingerprint
*before* llama.cpp loads it: to reject a bad file with a one-line error and to tell whether a saved KV
state belongs to this model. The fingerprint is the sha256 of the header and tensor infos (everything
before the tensor data), so it is the same however the header was parsed.

Two parsers give the same ``GGUFInfo``: ggml's own GGUF reader (C, through ctypes on the ggml library that
llama-cpp-python ships: a few ms, vocabulary included) and a pure-Python one. The Python one walks every
vocabulary and merge string (~130 ms for a 49k vocabulary), so it is only the fallback: when the ggml
library cannot be found, or when ggml refuses the file (then its error message is the one we show).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from chatcli.errors import ChatcliError, Kind

GGUF_MAGIC = b"GGUF"

# GGUF value types (gguf spec).
_SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
# ggml tensor type -> (elements per block, bytes per block), as in gguf-py's GGML_QUANT_SIZES. A type not
# listed here (a newer one) only loses the exact end-of-data check, never the file.
_QK_K = 256
_TYPE_SIZES: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    10: (_QK_K, 4 + _QK_K // 16 + _QK_K // 4), 11: (_QK_K, 2 + _QK_K // 4 + _QK_K // 8 + 12),
    12: (_QK_K, 4 + _QK_K // 2 + 12), 13: (_QK_K, 4 + _QK_K // 2 + _QK_K // 8 + 12),
    14: (_QK_K, 2 + _QK_K // 2 + _QK_K // 4 + _QK_K // 16), 15: (_QK_K, 4 + _QK_K + _QK_K // 8),
    16: (_QK_K, 2 + _QK_K // 4), 17: (_QK_K, 2 + _QK_K // 4 + _QK_K // 32),
    18: (_QK_K, 2 + _QK_K // 4 + _QK_K // 8), 19: (_QK_K, 2 + _QK_K // 8 + _QK_K // 16), 20: (32, 18),
    21: (_QK_K, 2 + _QK_K // 4 + _QK_K // 8 + _QK_K // 32 + 4), 22: (_QK_K, 2 + _QK_K // 4 + _QK_K // 16),
    23: (_QK_K, 4 + _QK_K // 2 + _QK_K // 64), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
    29: (_QK_K, _QK_K // 8 + _QK_K // 16 + _QK_K // 32), 30: (1, 2), 34: (_QK_K, 2 + 4 * 13),
    35: (_QK_K, 2 + 64), 39: (32, 17),
}
# Guards so a corrupt or hostile header cannot make us allocate gigabytes.
_MAX_STRING = 64 * 1024 * 1024
_MAX_COUNT = 1 << 24


class GGUFError(ChatcliError, ValueError):
    """The file is not a readable GGUF model."""

    kind: Kind = "usage"


@dataclass
class GGUFInfo:
    """What chatcli reads from a GGUF header."""

    path: Path
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    n_tensors: int = 0
    header_sha256: str = ""
    file_size: int = 0

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    @property
    def name(self) -> str:
        return str(self.metadata.get("general.name", self.path.stem))

    @property
    def context_length(self) -> int | None:
        value = self.metadata.get(f"{self.architecture}.context_length")
        return int(value) if value is not None else None

    @property
    def chat_template(self) -> str | None:
        value = self.metadata.get("tokenizer.chat_template")
        return str(value) if value else None


class _Reader:
    """Reads from a growing in-memory copy of the file's head: per-field file reads are too slow
    for vocabularies of 100k+ strings."""

    def __init__(self, fh: BinaryIO, size: int) -> None:
        self.fh = fh
        self.size = size
        self.buf = bytearray()
        self.pos = 0

    def _need(self, n: int) -> None:
        while self.pos + n > len(self.buf):
            chunk = self.fh.read(max(1 << 20, self.pos + n - len(self.buf)))
            if not chunk:
                raise GGUFError("truncated GGUF header")
            self.buf += chunk

    def read(self, n: int) -> bytes:
        self._need(n)
        data = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        self._need(n)
        self.pos += n

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self, keep: bool = True) -> str:
        n = self.scalar("<Q")
        if n > _MAX_STRING or n > self.size:
            raise GGUFError("corrupt GGUF header (string length)")
        if not keep:
            self.skip(n)
            return ""
        return self.read(n).decode("utf-8", errors="replace")

    def value(self, vtype: int, keep: bool = True) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string(keep)
        if vtype == _ARRAY:
            item_type = self.scalar("<I")
            count = self.scalar("<Q")
            if count > _MAX_COUNT * 64:
                raise GGUFError("corrupt GGUF header (array length)")
            if item_type in _SCALARS and not keep:
                # Token score/type arrays are big and of no use to us: skip them.
                self.skip(struct.calcsize(_SCALARS[item_type]) * count)
                return None
            if item_type == _STRING and not keep:
                self._skip_strings(count)
                return None
            items = [self.value(item_type, keep) for _ in range(count)]
            return items if keep else None
        raise GGUFError(f"corrupt GGUF header (value type {vtype})")

    def _skip_strings(self, count: int) -> None:
        # A tight loop: vocabularies and merges are arrays of ~50k-250k strings.
        unpack = struct.unpack_from
        for _ in range(count):
            self._need(8)
            (n,) = unpack("<Q", self.buf, self.pos)
            if n > _MAX_STRING:
                raise GGUFError("corrupt GGUF header (string length)")
            self.pos += 8
            if self.pos + n > len(self.buf):
                self._need(n)
            self.pos += n

    def digest(self) -> str:
        """sha256 of everything parsed so far: the header and tensor infos."""
        return hashlib.sha256(bytes(self.buf[:self.pos])).hexdigest()


# Large arrays we never need in Python (the tokenizer lives in llama.cpp).
_SKIP_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def read_gguf(path: str | Path, *, native: bool = True) -> GGUFInfo:
    """Parse the header and tensor infos of a GGUF file; raise GGUFError if it is not one.

    ``native=False`` forces the pure-Python parser (tests compare the two).
    """
    if native:
        info = _read_native(Path(path))
        if info is not None:
            return info
    return _read_python(Path(path))


def _read_python(p: Path) -> GGUFInfo:
    try:
        size = p.stat().st_size
        fh = p.open("rb")
    except FileNotFoundError:
        raise GGUFError(f"model file not found: {p}") from None
    except IsADirectoryError:
        raise GGUFError(f"model path is a directory, not a GGUF file: {p}") from None
    except OSError as exc:
        raise GGUFError(f"cannot read model file {p}: {exc.strerror}") from None
    with fh:
        r = _Reader(fh, size)
        try:
            if size < 24 or r.read(4) != GGUF_MAGIC:
                raise GGUFError(f"not a GGUF model file: {p}")
            version = r.scalar("<I")
            if version not in (2, 3):
                raise GGUFError(f"unsupported GGUF version {version}: {p}")
            n_tensors = r.scalar("<Q")
            n_kv = r.scalar("<Q")
            if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
                raise GGUFError(f"corrupt GGUF header: {p}")
            meta: dict[str, Any] = {}
            for _ in range(n_kv):
                key = r.string()
                vtype = r.scalar("<I")
                meta[key] = r.value(vtype, keep=key not in _SKIP_KEYS)
            # Tensor infos: name, dims, type, offset. Hashing them fingerprints the weights' layout.
            end_of_data = 0
            for _ in range(n_tensors):
                r.string()
                n_dims = r.scalar("<I")
                if n_dims > 8:
                    raise GGUFError(f"corrupt GGUF header: {p}")
                n_elements = 1
                for _ in range(n_dims):
                    n_elements *= r.scalar("<Q")
                block, block_bytes = _TYPE_SIZES.get(r.scalar("<I"), (1, 0))
                end_of_data = max(end_of_data, r.scalar("<Q") + n_elements // block * block_bytes)
        except (struct.error, GGUFError) as exc:
            if isinstance(exc, GGUFError) and str(exc).endswith(str(p)):
                raise
            raise GGUFError(f"corrupt or truncated GGUF header: {p}") from None
        except OSError as exc:
            raise GGUFError(f"cannot read model file {p}: {exc.strerror}") from None
        header_end = r.pos
        # Tensor data starts at the next multiple of the alignment: a download cut short anywhere in it
        # is caught here, with a clear message, rather than by llama.cpp after a slow, failing load.
        align = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
        align = align if isinstance(align, int) and not isinstance(align, bool) and align > 0 else _DEFAULT_ALIGNMENT
        data_start = -(-header_end // align) * align
        if data_start + end_of_data > size:
            raise GGUFError(f"truncated GGUF file (tensor data missing): {p}")
    return GGUFInfo(
        path=p, version=version, metadata=meta, n_tensors=n_tensors,
        header_sha256=r.digest(), file_size=size,
    )


# -- ggml's GGUF reader, through ctypes ---------------------------------------------------------------

class _GGUFInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


_LOG_CB_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


def _discard_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # ggml's default logger prints to stderr; a refused file is reported by the Python parser instead.
    pass


_quiet_log = _LOG_CB_TYPE(_discard_log)


_GGML: ctypes.CDLL | None = None
_GGML_TRIED = False


def _ggml_lib() -> ctypes.CDLL | None:
    """ggml's base library from llama-cpp-python's package directory, found without importing llama_cpp
    (that import costs more than the whole header read). None when it is not there."""
    global _GGML, _GGML_TRIED
    if _GGML_TRIED:
        return _GGML
    _GGML_TRIED = True
    if os.environ.get("CHATCLI_GGUF_PYTHON"):  # escape hatch: force the pure-Python parser
        return None
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    dirs = [Path(override)] if override else [Path(d) / "lib" for d in spec.submodule_search_locations]
    ext = ".dll" if sys.platform == "win32" else ".dylib" if sys.platform == "darwin" else ".so"
    names = [f"libggml-base{ext}", f"ggml-base{ext}", f"libggml{ext}", f"ggml{ext}"]
    for d in dirs:
        for name in names:
            f = d / name
            if not f.is_file():
                continue
            try:
                lib = ctypes.CDLL(str(f))
                _declare(lib)
            except (OSError, AttributeError):
                continue
            _GGML = lib
            return lib
    return None


def _declare(lib: ctypes.CDLL) -> None:
    vp, i64, sz = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t
    sigs: dict[str, tuple[Any, list[Any]]] = {
        "gguf_init_from_file": (vp, [ctypes.c_char_p, _GGUFInitParams]),
        "gguf_free": (None, [vp]),
        "gguf_get_version": (ctypes.c_uint32, [vp]),
        "gguf_get_alignment": (sz, [vp]),
        "gguf_get_data_offset": (sz, [vp]),
        "gguf_get_n_kv": (i64, [vp]),
        "gguf_get_key": (ctypes.c_char_p, [vp, i64]),
        "gguf_get_kv_type": (ctypes.c_int, [vp, i64]),
        "gguf_get_arr_type": (ctypes.c_int, [vp, i64]),
        "gguf_get_val_data": (vp, [vp, i64]),
        "gguf_get_val_str": (ctypes.c_char_p, [vp, i64]),
        "gguf_get_arr_n": (sz, [vp, i64]),
        "gguf_get_arr_data": (vp, [vp, i64]),
        "gguf_get_arr_str": (ctypes.c_char_p, [vp, i64, sz]),
        "gguf_get_n_tensors": (i64, [vp]),
        "gguf_get_tensor_offset": (sz, [vp, i64]),
        "gguf_get_tensor_size": (sz, [vp, i64]),
        "ggml_log_get": (None, [ctypes.POINTER(vp), ctypes.POINTER(vp)]),
        "ggml_log_set": (None, [vp, vp]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


# gguf_type -> ctypes scalar type (same numbering as _SCALARS).
_CTYPES: dict[int, Any] = {
    0: ctypes.c_uint8, 1: ctypes.c_int8, 2: ctypes.c_uint16, 3: ctypes.c_int16, 4: ctypes.c_uint32,
    5: ctypes.c_int32, 6: ctypes.c_float, 7: ctypes.c_bool, 10: ctypes.c_uint64, 11: ctypes.c_int64,
    12: ctypes.c_double,
}


def _read_native(p: Path) -> GGUFInfo | None:
    """The same GGUFInfo as the Python parser, from ggml's reader; None to fall back to the Python one."""
    lib = _ggml_lib()
    if lib is None:
        return None
    try:
        size = p.stat().st_size
        with p.open("rb") as fh:
            head = fh.read(8)
    except OSError:
        return None  # the Python parser words the error
    if size < 24 or head[:4] != GGUF_MAGIC or struct.unpack("<I", head[4:8])[0] not in (2, 3):
        return None
    old_cb, old_data = ctypes.c_void_p(), ctypes.c_void_p()
    lib.ggml_log_get(ctypes.byref(old_cb), ctypes.byref(old_data))
    lib.ggml_log_set(ctypes.cast(_quiet_log, ctypes.c_void_p), None)
    try:
        ctx = lib.gguf_init_from_file(os.fsencode(p), _GGUFInitParams(True, None))
    finally:
        lib.ggml_log_set(old_cb, old_data)
    if not ctx:
        return None
    try:
        return _info_from_ctx(lib, ctx, p, size)
    finally:
        lib.gguf_free(ctx)


def _info_from_ctx(lib: ctypes.CDLL, ctx: int, p: Path, size: int) -> GGUFInfo | None:
    meta: dict[str, Any] = {}
    for i in range(lib.gguf_get_n_kv(ctx)):
        key = lib.gguf_get_key(ctx, i).decode("utf-8", errors="replace")
        vtype = lib.gguf_get_kv_type(ctx, i)
        if key in _SKIP_KEYS:
            meta[key] = None
        elif vtype == _STRING:
            meta[key] = lib.gguf_get_val_str(ctx, i).decode("utf-8", errors="replace")
        elif vtype in _CTYPES:
            meta[key] = _CTYPES[vtype].from_address(lib.gguf_get_val_data(ctx, i)).value
        elif vtype == _ARRAY:
            atype, n = lib.gguf_get_arr_type(ctx, i), lib.gguf_get_arr_n(ctx, i)
            if atype == _STRING:
                meta[key] = [lib.gguf_get_arr_str(ctx, i, j).decode("utf-8", errors="replace") for j in range(n)]
            elif atype in _CTYPES:
                meta[key] = list((_CTYPES[atype] * n).from_address(lib.gguf_get_arr_data(ctx, i))) if n else []
            else:
                return None  # nested arrays: ggml refuses them anyway
        else:
            return None
    n_tensors = int(lib.gguf_get_n_tensors(ctx))
    data_start = int(lib.gguf_get_data_offset(ctx))
    end_of_data = max((lib.gguf_get_tensor_offset(ctx, t) + lib.gguf_get_tensor_size(ctx, t)
                       for t in range(n_tensors)), default=0)
    if data_start + end_of_data > size:
        raise GGUFError(f"truncated GGUF file (tensor data missing): {p}")
    # The fingerprint covers the header up to the last tensor info, without the zero padding before the
    # data. ggml gives the padded offset; the header ends with the last tensor's offset (u64), so the end is
    # the one place in the padding window where those 8 bytes stand followed only by zeros.
    align = int(lib.gguf_get_alignment(ctx))
    with p.open("rb") as fh:
        blob = fh.read(data_start)
    if len(blob) != data_start:
        return None
    if n_tensors == 0:
        header_end = data_start
    else:
        last = struct.pack("<Q", lib.gguf_get_tensor_offset(ctx, n_tensors - 1))
        ends = [e for e in range(max(24, data_start - align + 1), data_start + 1)
                if blob[e - 8:e] == last and not blob[e:data_start].strip(b"\0")]
        if len(ends) != 1:
            return None  # ambiguous (a last offset of 0): let the Python parser find the end
        header_end = ends[0]
    return GGUFInfo(
        path=p, version=int(lib.gguf_get_version(ctx)), metadata=meta, n_tensors=n_tensors,
        header_sha256=hashlib.sha256(memoryview(blob)[:header_end]).hexdigest(), file_size=size,
    )
