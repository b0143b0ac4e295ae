"""A minimal, read-only GGUF header parser.

chatcli needs a model's metadata (architecture, trained context, chat template) and a cheap fingerprint
*before* llama.cpp loads it: to reject a bad file with a one-line error and to tell whether a saved KV
state belongs to this model. Reading the header and tensor infos costs a few ms, whatever the file size.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

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


class GGUFError(ValueError):
    """The file is not a readable GGUF model."""


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


def read_gguf(path: str | Path) -> GGUFInfo:
    """Parse the header and tensor infos of a GGUF file; raise GGUFError if it is not one."""
    p = Path(path)
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
