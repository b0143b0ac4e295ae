"""The per-architecture fixture helper (tests/archs.py): generation, and template copies llama.cpp reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.archs import ArchFixtures, GenerationError, generate, gguf_module, with_template

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _meta(path: Path, key: str) -> str | None:
    """``key`` as llama.cpp itself reads it from the GGUF (vocab-only load: no weights)."""
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"llama.cpp could not load {path}"
    try:
        buf = bytes(4096)
        n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
        return buf[:n].decode() if n >= 0 else None
    finally:
        llama_cpp.llama_model_free(model)


def test_fixture_is_generated_once_per_architecture(archs_bin: Path, tmp_path: Path) -> None:
    # A directory of its own: the session's shared one holds whatever other tests generated (qwen35...).
    arch_fixtures = ArchFixtures(tmp_path, binary=archs_bin)
    path = arch_fixtures.path("qwen3")
    assert path.name == "qwen3-dense.gguf"
    mtime = path.stat().st_mtime_ns
    # An exact name is anchored: qwen3 must not also have built qwen35/qwen3moe/qwen3next.
    assert sorted(p.name for p in path.parent.glob("qwen3*")) == ["qwen3-dense.gguf"]
    assert arch_fixtures.path("qwen3-dense") == path
    assert path.stat().st_mtime_ns == mtime
    assert _meta(path, "general.architecture") == "qwen3"
    assert _meta(path, "tokenizer.chat_template") is None  # what with_template is for


def test_unknown_architecture_is_one_clear_error(archs_bin: Path, tmp_path: Path) -> None:
    with pytest.raises(GenerationError, match="wrote no fixture"):
        generate(tmp_path, "^no-such-arch$", binary=archs_bin)


def test_with_template_copies_everything_and_sets_the_template(arch_fixtures: ArchFixtures, tmp_path: Path) -> None:
    src = arch_fixtures.path("llama")
    dst = with_template(src, TEMPLATE, tmp_path / "llama-chat.gguf", eos=3, eot=4)
    assert _meta(dst, "tokenizer.chat_template") == TEMPLATE
    assert _meta(dst, "tokenizer.ggml.eos_token_id") == "3"
    assert _meta(dst, "tokenizer.ggml.eot_token_id") == "4"
    gguf = gguf_module()
    before, after = gguf.gguf_reader.GGUFReader(str(src)), gguf.gguf_reader.GGUFReader(str(dst))
    assert [t.name for t in before.tensors] == [t.name for t in after.tensors]
    for a, b in zip(before.tensors, after.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data), a.name
    # Every field but the empty arrays the writer cannot type survives with its value.
    skipped = {k for k, f in before.fields.items() if f.types == [gguf.constants.GGUFValueType.ARRAY]}
    for key, field in before.fields.items():
        if key.startswith("GGUF.") or key in skipped:
            continue
        assert after.fields[key].contents() == field.contents(), key
