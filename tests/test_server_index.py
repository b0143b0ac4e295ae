"""The server's prefix index keeps up with the store between requests (``PrefixIndex.refresh``): new, changed
and removed conversations, and only folders that are conversations. No model: the bookkeeping only."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatcli.core.files.index import PrefixPut
from chatcli.core.files.store import ConversationStore
from chatcli.server.index import PrefixIndex


def test_refresh_follows_the_store_and_rereads_only_changed_transcripts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ConversationStore(tmp_path / "conversations")
    idx = PrefixIndex(store, tmp_path / "index.json", model_identity={"m": 1}, n_ctx=4096, template_source="t")
    idx.refresh()
    assert len(idx) == 0  # no conversations folder yet: nothing, no error

    a = store.create({"title": "a"})
    a.append_event({"type": "note", "text": "x"})
    b = store.create({"title": "b"})
    b.append_event({"type": "note", "text": "y"})
    (store.root / "Not-An-Id").mkdir()  # not a conversation folder name
    (store.root / "zzzfile").write_text("")  # a file, not a folder
    reread: list[str] = []
    real = PrefixIndex._index_dir

    def spy(self: PrefixIndex, conv: object, size: int, mtime: int, warm: bool) -> PrefixPut:
        reread.append(conv.id)  # type: ignore[attr-defined]
        return real(self, conv, size, mtime, warm)  # type: ignore[arg-type]

    monkeypatch.setattr(PrefixIndex, "_index_dir", spy)
    idx.refresh(save=False)
    assert sorted(reread) == sorted([a.id, b.id]) and len(idx) == 2
    assert store.index is not None
    saved = lambda: dict(store.index.extra(idx._name + "-seq"))  # the change number the rows are caught up with
    # save=False: not written before a request's first token (the rows are, as they change)
    assert saved() != {"seq": str(idx._seq)}
    reread.clear()
    idx.refresh()
    assert reread == []  # nothing changed: only stats
    assert saved() == {"seq": str(idx._seq)}

    a.append_event({"type": "note", "text": "more"})  # another process wrote it
    idx.refresh()
    assert reread == [a.id]
    reread.clear()
    (b.transcript_path).unlink()  # behind chatcli's back: seen when the folders are reconciled
    idx.refresh(full=True)
    assert len(idx) == 1 and reread == []
    store.remove(a)
    idx.refresh()
    assert len(idx) == 0
    assert idx._transcript == a.transcript_path.name  # the store's own file name
