"""The state file's read path: one mapped pass, each record's crc checked once, zero-copy payloads."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from chatcli.backends.llamacpp import Engine
from chatcli.core.kv import records as sf


def _write(path: Path, payloads: list[tuple[int, int, int, bytes]]) -> None:
    records = [sf.encode_record(sf.HEADER, 0, 0, sf.header_payload({"m": 1}))]
    records += [sf.encode_record(kind, p0, p1, data) for kind, p0, p1, data in payloads]
    sf.StateWriter(path).rewrite(records)


def test_mapped_scan_payloads_and_damage(tmp_path: Path) -> None:
    path = tmp_path / "state.kv"
    cells = sf.cells_payload([5, 6, 7], b"kv-bytes" * 100)
    logits = np.arange(10, dtype="<f4").tobytes()
    _write(path, [(sf.CELLS, 0, 3, cells), (sf.LOGITS, 3, 3, logits), (sf.CELLS, 3, 4, sf.cells_payload([9], b"x"))])
    with sf.map_state(path) as ms:
        res = ms.result
        assert res.header == {"format": sf.FORMAT_VERSION, "identity": {"m": 1}} and not res.problem
        assert [r.kind for r in res.records] == [sf.HEADER, sf.CELLS, sf.LOGITS, sf.CELLS]
        assert res.valid_bytes == path.stat().st_size and res.dropped_bytes == 0
        toks, kv = ms.cells(res.records[1])
        assert toks == [5, 6, 7] and isinstance(kv, memoryview) and bytes(kv) == b"kv-bytes" * 100
        assert bytes(ms.payload(res.records[2])) == logits
        assert bytes(ms.payload(res.records[1])) == sf.read_payload(path, res.records[1])
        del kv
    with sf.map_state(path, background=True) as ms:
        assert all(ms.wait_ok(r) for r in ms.records.records)
        assert ms.result == res
    # A flipped payload byte in the middle record: it and everything after it are dropped, once.
    data = bytearray(path.read_bytes())
    rec = res.records[2]
    data[rec.offset + sf.HEADER_SIZE + 3] ^= 1
    path.write_bytes(bytes(data))
    bad = sf.scan(path)
    # Checked in the background: the records before the damage are good, the damaged one and later not,
    # and the final answer is the same as the synchronous scan's.
    with sf.map_state(path, background=True) as ms:
        recs = ms.records.records
        assert len(recs) == 4  # the header index alone cannot see the damage
        assert ms.wait_ok(recs[1]) and not ms.wait_ok(recs[2]) and not ms.wait_ok(recs[3])
        assert ms.result == bad
    assert bad.problem == "checksum mismatch"
    assert [r.kind for r in bad.records] == [sf.HEADER, sf.CELLS]
    assert bad.valid_bytes == rec.offset and bad.dropped_bytes == len(data) - rec.offset
    # Empty and missing files.
    path.write_bytes(b"")
    assert sf.scan(path).problem == "empty"
    assert sf.scan(tmp_path / "nope.kv").problem == "missing"


def test_load_cells_from_a_mapped_view_is_bit_identical(engine: Engine, tmp_path: Path) -> None:
    """Cells loaded through a view into the mapped file give the same logits as evaluating the tokens."""
    engine.clear()
    toks = engine.tokenize("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    engine.eval(toks[:-1])
    kv = engine.save_cells(0, engine.n_past)
    engine.eval(toks[-1:])
    want = engine.logits()
    path = tmp_path / "state.kv"
    _write(path, [(sf.CELLS, 0, len(toks) - 1, sf.cells_payload(toks[:-1], kv))])
    engine.clear()
    with sf.map_state(path) as ms:
        rec = ms.result.records[1]
        got_toks, view = ms.cells(rec)
        engine.load_cells(rec.p0, rec.p1, view, got_toks)
        view.release()
    assert engine.tokens == toks[:-1]
    engine.eval(toks[-1:])
    assert np.array_equal(engine.logits(), want)


def test_a_record_made_from_parts_and_appended_unjoined_is_the_joined_ones_bytes(tmp_path: Path) -> None:
    """The write path of a turn's cells never copies them (a view of the buffer llama.cpp wrote, megabytes)
    and never joins a record or the records: the file holds exactly what encoding the joined payload and
    appending (or rewriting with) one joined blob wrote."""
    toks, kv = [5, 6, 7], memoryview(np.frombuffer(bytes(range(256)) * 40, dtype=np.uint8)).toreadonly()
    parts = sf.encode_record_parts(sf.CELLS, 0, 3, sf.cells_parts(toks, kv), flags=sf.NOT_A_POINT)
    joined = sf.encode_record(sf.CELLS, 0, 3, sf.cells_payload(toks, bytes(kv)), flags=sf.NOT_A_POINT)
    assert isinstance(parts, sf.RecordParts) and sf.raw_bytes(parts) == joined and len(parts) == len(joined)
    recs: list[sf.Raw] = [parts, sf.encode_record(sf.LOGITS, 3, 3, b"\0" * 40), sf.encode_record(sf.TRUNCATE, 3, 3, b"")]
    a, b, c = tmp_path / "a.kv", tmp_path / "b.kv", tmp_path / "c.kv"
    assert sf.StateWriter(a).append(recs) == sum(len(r) for r in recs)
    from chatcli.core.files.fsutil import append_durably

    append_durably(b, b"".join(sf.raw_bytes(r) for r in recs))
    assert sf.StateWriter(c).rewrite(recs) == a.stat().st_size
    assert a.read_bytes() == b.read_bytes() == c.read_bytes() and sf.StateWriter(a).append([]) == 0
    assert sf.records_at(recs, 0)[1] == a.stat().st_size


def _revive(path: Path, rec: sf.Record, p0: int | None = None) -> bytes:
    return sf.encode_record(sf.REVIVE, rec.p0 if p0 is None else p0, rec.p1,
                            sf.revive_payload(rec.offset, sf.stored_crc(path, rec)))


def test_a_revive_record_makes_the_record_it_names_live_again(tmp_path: Path) -> None:
    """/redo and /alt append a REVIVE record instead of a copy of the cells they read back: the state then
    reads those cells from the record named (a SPARE one counts as CELLS), only if its offset, crc, kind and
    positions are those of a record of the same file; anything else is damage, cut there as a record that
    does not continue the state is."""
    path = tmp_path / "state.kv"
    a, b = sf.cells_payload([5, 6, 7], b"a" * 50), sf.cells_payload([8, 9], b"b" * 40)
    _write(path, [(sf.CELLS, 0, 3, a), (sf.SPARE, 3, 5, b), (sf.TRUNCATE, 3, 3, b""),
                  (sf.CELLS, 3, 4, sf.cells_payload([1], b"x")), (sf.TRUNCATE, 3, 3, b"")])
    head = sf.scan(path)
    rec_a, spare = head.records[1], head.records[2]
    writer = sf.StateWriter(path)
    more = [_revive(path, spare), sf.encode_record(sf.CELLS, 5, 6, sf.cells_payload([4], b"y"))]
    writer.append(more)
    head.add(more)  # the writer's own index of what it appended
    for res in (sf.scan(path), head):
        assert not res.problem and [r.kind for r in res.records][-2:] == [sf.REVIVE, sf.CELLS]
        chunks, _, n = res.live()
        assert n == 6
        assert [(c.record.kind, c.record.p0, c.end) for c in chunks] == [(sf.CELLS, 0, 3), (sf.CELLS, 3, 5), (sf.CELLS, 5, 6)]
        view = chunks[1].record
        assert (view.offset, view.length, view.via) == (spare.offset, spare.length, res.records[-2].offset)
        assert sf.read_payload(path, view) == b and view in res.points()
    with sf.map_state(path, background=True) as ms:
        view = ms.records.live()[0][1].record
        assert ms.wait_ok(view) and ms.cells(view)[0] == [8, 9]
    # From position 0 a revived record replaces everything before it, as a snapshot does.
    writer.append([sf.encode_record(sf.TRUNCATE, 0, 0, b""), _revive(path, rec_a)])
    chunks, _, n = sf.scan(path).live()
    assert n == 3 and [(c.record.kind, c.record.offset) for c in chunks] == [(sf.SNAPSHOT, rec_a.offset)]
    good = path.stat().st_size
    # Damaged revived cells: the crc check in file order fails the REVIVE record's view too.
    data = bytearray(path.read_bytes())
    data[rec_a.offset + sf.HEADER_SIZE + 13] ^= 1
    path.write_bytes(bytes(data))
    with sf.map_state(path, background=True) as ms:
        assert not ms.wait_ok(ms.records.live()[0][0].record)
    data[rec_a.offset + sf.HEADER_SIZE + 13] ^= 1
    path.write_bytes(bytes(data))
    # A REVIVE naming no record of the state's cells: a wrong crc, a record that is not cells, another
    # record's positions, or positions that do not continue the state.
    logits = sf.encode_record(sf.LOGITS, 3, 3, b"\0" * 8)
    writer.append([logits])
    logits_rec = sf.scan(path).records[-1]
    for bad in (sf.encode_record(sf.REVIVE, 3, 5, sf.revive_payload(spare.offset, sf.stored_crc(path, spare) ^ 1)),
                sf.encode_record(sf.REVIVE, 3, 3, sf.revive_payload(logits_rec.offset, sf.stored_crc(path, logits_rec))),
                _revive(path, spare, p0=4), _revive(path, head.records[-1]),
                sf.encode_record(sf.REVIVE, 3, 5, b"short")):
        base = path.read_bytes()[:good + len(logits)]
        path.write_bytes(base + bad)
        res = sf.scan(path)
        assert res.problem.startswith(f"revive record at {len(base)}"), res.problem
        assert res.valid_bytes == len(base) and res.dropped_bytes == len(bad)


def test_every_public_name_of_the_records_module_is_in_its_all() -> None:
    """``records.__all__`` names what the module offers (SPARE and read_tokens were once left out of it)."""
    import types

    own = {name for name, v in vars(sf).items() if not name.startswith("_") and not isinstance(v, types.ModuleType)
           and (getattr(v, "__module__", None) == sf.__name__ or name.isupper() or isinstance(v, types.UnionType))}
    assert own == set(sf.__all__)


def test_a_record_of_no_cells_does_not_end_the_live_state(tmp_path: Path) -> None:
    # An empty persona prefix (an API conversation without a system message) was saved as CELLS [0, 0); the
    # restore stopped at that chunk and evaluated the whole conversation again. Files holding one still load.
    path = tmp_path / "state.kv"
    _write(path, [(sf.CELLS, 0, 0, sf.cells_payload([], b"")), (sf.CELLS, 0, 3, sf.cells_payload([5, 6, 7], b"kv")),
                  (sf.CELLS, 3, 4, sf.cells_payload([9], b"x"))])
    chunks, _, n = sf.scan(path).live()
    assert n == 4 and [(c.record.p0, c.end) for c in chunks] == [(0, 3), (3, 4)]
