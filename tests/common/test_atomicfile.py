"""The one write-then-rename (mpiddp/atomicfile.py): every variant leaves the old file or the new one, and no
temporary file behind."""

import os
import threading

import pytest

from mpiddp.atomicfile import UMASK, move, write_atomic, write_bytes_atomic, write_new, write_text_atomic


def test_each_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "record.json"
    write_text_atomic(target, "one")
    write_bytes_atomic(target, b"two")
    assert target.read_text() == "two"
    write_atomic(target, lambda out: out.write(b"three"), durable=True)
    assert target.read_text() == "three"
    assert os.stat(target).st_mode & 0o777 == 0o666 & ~UMASK  # readable by teammates, as open() would make it
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_a_write_that_fails_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "summary.json"
    write_text_atomic(target, "old")

    def broken(out):
        out.write(b"half")
        raise ValueError("not serialisable")

    with pytest.raises(ValueError):
        write_atomic(target, broken)
    with pytest.raises(OSError):
        write_text_atomic(tmp_path / "missing" / "x", "y")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_write_new_keeps_the_first_complete_file_however_many_race(tmp_path):
    target = tmp_path / "rank-0.json"
    results: list[bool] = []
    threads = [threading.Thread(target=lambda n=n: results.append(write_new(target, f"writer {n}"))) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 7 + [True]
    assert target.read_text().startswith("writer ")
    assert not write_new(target, "late") and target.read_text() != "late"
    assert [p.name for p in tmp_path.iterdir()] == ["rank-0.json"]


def test_move_replaces_in_one_step(tmp_path):
    (tmp_path / "a").write_text("new")
    (tmp_path / "b").write_text("old")
    move(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b").read_text() == "new" and not (tmp_path / "a").exists()
    with pytest.raises(FileNotFoundError):
        move(tmp_path / "a", tmp_path / "b")
