"""llama.cpp's own per-architecture fixture GGUFs, generated at test time (issue #20).

``test-llama-archs`` (built beside llama-server by ``scripts/build_llama_server.sh``, from the same sdist)
writes a small random-weight GGUF for every architecture it supports: ``test-llama-archs -o DIR -a REGEX``
gives ``DIR/<arch>-dense.gguf`` and/or ``DIR/<arch>-moe.gguf``. Nothing is committed or downloaded.

What the fixtures lack, as any GGUF may: their tokenizer is llama.cpp's dummy ``test`` vocabulary (5 characters
per token, no BOS, no EOS, no EOT, no chat template), and their trained context is 256 tokens. So callers use a
small ``n_ctx`` (≤ 256) and a small ``max_tokens`` (no reply ever ends by itself); ``with_template`` writes a copy
with a chat template and, optionally, EOS/EOT ids.

Generating all 128 fixtures takes ~6 s and ~900 MB (deepseek4-moe alone is 86 MB), so the test fixture
generates lazily, one architecture at a time, into the session's tmp dir: fast enough that a cache across
sessions is not worth its invalidation.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from tests.remote_server import FLAVOUR, LLAMA_VERSION


def _build_dir() -> Path:
    root = os.environ.get("CHATCLI_LLAMA_SERVER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "chatcli")
    return Path(root) / f"llama-server-{LLAMA_VERSION}-{FLAVOUR}"


@functools.cache
def archs_binary() -> Path | None:
    """The ``test-llama-archs`` to generate fixtures with, or None when it was not built. Looked up once (the
    tests' autouse fixture clears CHATCLI_* variables later): ``$CHATCLI_TEST_LLAMA_ARCHS``, else the build
    cache, found as ``tests.remote_server.server_binary`` finds llama-server."""
    explicit = os.environ.get("CHATCLI_TEST_LLAMA_ARCHS")
    path = Path(explicit) if explicit else _build_dir() / "bin" / "test-llama-archs"
    return path if path.is_file() and os.access(path, os.X_OK) else None


SKIP_REASON = ("test-llama-archs is not built: run scripts/build_llama_server.sh (or scripts/setup.sh --with-server), "
               "or point CHATCLI_TEST_LLAMA_ARCHS at a test-llama-archs binary")

# The fixtures' metadata that callers must work around (see the module docstring).
N_CTX_TRAIN = 256


class GenerationError(RuntimeError):
    """test-llama-archs failed or wrote nothing for the architectures asked for."""


def generate(out_dir: Path, arch: str | None = None, *, binary: Path | None = None, seed: int = 42,
             timeout: float = 300.0) -> dict[str, Path]:
    """Write the fixtures for ``arch`` (an exact architecture name, or a regex; None = all) into ``out_dir``.

    Args:
        out_dir: created if missing (test-llama-archs itself fails on a missing directory, per file).
        arch: llama.cpp architecture name (``granitehybrid``) or regex (``^qwen3``); None for every one.
        binary: the generator; default ``archs_binary()``.
        seed: the weights' seed (fixed, so fixtures are the same from run to run).
        timeout: seconds for the whole run.

    Returns:
        fixture name (``llama-dense``, ``llama-moe``, ``granitehybrid-dense``…) → path, only those written now.
    """
    exe = binary or archs_binary()
    if exe is None:
        raise GenerationError(SKIP_REASON)
    out_dir.mkdir(parents=True, exist_ok=True)
    before = {p.name: p.stat().st_mtime_ns for p in out_dir.glob("*.gguf")}
    args = [str(exe), "-o", str(out_dir), "-s", str(seed)]
    if arch is not None:
        args += ["-a", arch]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    # It reports a file it could not write on stderr but still exits 0: look for those lines too.
    failed = [line for line in proc.stderr.splitlines() if " E " in line]
    if proc.returncode != 0 or failed:
        detail = failed[0] if failed else (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise GenerationError(f"test-llama-archs {' '.join(args[1:])} failed (exit {proc.returncode}): {detail}")
    written = {p.stem: p for p in sorted(out_dir.glob("*.gguf"))
               if before.get(p.name) != p.stat().st_mtime_ns}
    if not written:
        raise GenerationError(f"test-llama-archs wrote no fixture for {arch!r} (unsupported architecture?)")
    return written


class ArchFixtures:
    """Fixture GGUFs in one directory, generated on first use, one architecture at a time."""

    def __init__(self, out_dir: Path, *, binary: Path | None = None) -> None:
        self.out_dir = out_dir
        self.binary = binary
        self._done: set[str] = set()

    def path(self, name: str) -> Path:
        """The fixture ``name``: an architecture (``granitehybrid``: its dense file, else its MoE file) or a
        fixture name (``llama-moe``)."""
        stem = re.sub(r"-(dense|moe)$", "", name)
        if stem not in self._done:
            # An exact name: test-llama-archs anchors it itself ("^name$"), so qwen3 does not also build qwen35.
            generate(self.out_dir, stem, binary=self.binary)
            self._done.add(stem)
        for candidate in ([name] if name != stem else [f"{stem}-dense", f"{stem}-moe"]):
            path = self.out_dir / f"{candidate}.gguf"
            if path.is_file():
                return path
        raise GenerationError(f"no fixture {name!r} in {self.out_dir}")


def gguf_module() -> ModuleType:
    """The sdist's gguf-py (beside the built tools), reader and writer only: they need numpy alone, while the
    package's ``__init__`` also imports its metadata and vocab helpers (PyYAML, sentencepiece…)."""
    existing = sys.modules.get("gguf")
    if existing is not None:
        return existing
    pkg_dir = _build_dir() / "gguf-py" / "gguf"
    if not (pkg_dir / "gguf_writer.py").is_file():
        raise GenerationError(f"gguf-py is missing: {pkg_dir} (built by scripts/build_llama_server.sh)")
    spec = importlib.machinery.ModuleSpec("gguf", None, is_package=True)
    spec.submodule_search_locations = [str(pkg_dir)]
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["gguf"] = pkg
    for sub in ("constants", "gguf_reader", "gguf_writer"):
        setattr(pkg, sub, importlib.import_module(f"gguf.{sub}"))
    return pkg


def with_template(src: Path, template: str, dst: Path, *, eos: int | None = None, eot: int | None = None) -> Path:
    """A copy of the GGUF ``src`` at ``dst`` with ``tokenizer.chat_template`` set to ``template`` and, when
    given, ``tokenizer.ggml.eos_token_id`` / ``eot_token_id``. Returns ``dst``.

    Fields holding an empty array are left out: gguf-py's writer cannot infer their element type (the fixtures
    have such a field), and llama.cpp treats a missing array as an empty one.
    """
    gguf = gguf_module()
    reader_mod, writer_mod, constants = gguf.gguf_reader, gguf.gguf_writer, gguf.constants
    value_type = constants.GGUFValueType
    reader = reader_mod.GGUFReader(str(src))
    arch_field = reader.get_field("general.architecture")
    if arch_field is None:
        raise GenerationError(f"{src} has no general.architecture")
    replaced: dict[str, tuple[Any, Any]] = {"tokenizer.chat_template": (template, value_type.STRING)}
    if eos is not None:
        replaced["tokenizer.ggml.eos_token_id"] = (eos, value_type.UINT32)
    if eot is not None:
        replaced["tokenizer.ggml.eot_token_id"] = (eot, value_type.UINT32)
    dst.parent.mkdir(parents=True, exist_ok=True)
    writer = writer_mod.GGUFWriter(str(dst), arch=arch_field.contents(), endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF.") or field.name in replaced:
            continue
        kind = field.types[0]
        if kind == value_type.ARRAY and len(field.data) == 0:
            continue
        sub_type = field.types[-1] if kind == value_type.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    for key, (value, kind) in replaced.items():
        writer.add_key_value(key, value, kind)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return dst
