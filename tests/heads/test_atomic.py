"""heads/atomic.py: a write that fails leaves the old file or directory and no temporaries; a
clean one replaces it whole; build_once builds a cache entry once."""

import json
import threading

import pytest

from specheads.heads import atomic


class Boom(RuntimeError):
    pass


def test_file_written_whole_and_a_failed_write_keeps_the_old_one(tmp_path):
    path = tmp_path / "sub" / "report.json"
    atomic.write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1} and path.read_text().endswith("\n")
    with pytest.raises(Boom):
        with atomic.temp_path(path) as tmp:
            tmp.write_text("half")
            raise Boom
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json"]  # no temporary left
    atomic.write_bytes(path, b"new")
    assert path.read_bytes() == b"new"


def test_staged_dir_replaces_whole_or_not_at_all(tmp_path):
    final = tmp_path / "heads"
    with atomic.staged_dir(final) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(Boom):
        with atomic.staged_dir(final) as tmp:
            (tmp / "b").write_text("2")
            raise Boom
    assert [p.name for p in final.iterdir()] == ["a"]
    with atomic.staged_dir(final) as tmp:
        (tmp / "c").write_text("3")
    assert [p.name for p in final.iterdir()] == ["c"]  # replaced, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads"]


def test_build_once_builds_one_entry_for_concurrent_callers(tmp_path):
    final = tmp_path / "cache" / "entry"
    calls = []

    def build(staging):
        calls.append(staging)
        (staging / "weights").write_text(str(len(calls)))

    threads = [threading.Thread(target=atomic.build_once, args=(final, build)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and (final / "weights").read_text() == "1"
    atomic.build_once(final, build, force=True)
    assert len(calls) == 2 and (final / "weights").read_text() == "2"
    with pytest.raises(Boom):
        atomic.build_once(tmp_path / "cache" / "broken", lambda staging: (_ for _ in ()).throw(Boom()))
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["broken.lock", "entry", "entry.lock"]
