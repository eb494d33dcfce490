"""durable.refuse_nonempty: the one 'refuse a non-empty folder unless resuming' rule."""

import pytest

from dflash.durable import refuse_nonempty
from dflash.errors import ConfigError


def test_absent_or_empty_or_only_ignored_entries_pass(tmp_path):
    refuse_nonempty(tmp_path / "new", what="run folder", remedy="r")
    refuse_nonempty(tmp_path, what="run folder", remedy="r")
    (tmp_path / ".lock").write_text("")
    refuse_nonempty(tmp_path, what="run folder", remedy="r", ignore=lambda n: n == ".lock")


def test_refusal_names_folder_entries_and_remedy(tmp_path):
    for n in ("a", "b", "c", "d"):
        (tmp_path / n).write_text("")
    with pytest.raises(ConfigError) as e:
        refuse_nonempty(tmp_path, what="run folder", remedy="pass --resume, or choose a new --output")
    assert str(e.value) == (f"run folder {str(tmp_path)!r} is not empty (a, b, c, ...): "
                            "pass --resume, or choose a new --output")
    with pytest.raises(ConfigError, match="exists and is not a folder"):
        refuse_nonempty(tmp_path / "a", what="run folder", remedy="r")


def test_a_folder_appearing_or_vanishing_meanwhile_is_no_refusal(tmp_path):
    """Rank 0 creates the run folder (taking its lock) while rank 1 checks it: the check sees the folder absent or
    empty, never "exists and is not a folder" (an isdir-then-exists pair did, once in a CI run)."""
    import os
    import threading

    folder = tmp_path / "run"
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            os.mkdir(folder)
            os.rmdir(folder)

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(3000):
            refuse_nonempty(folder, what="run folder", remedy="r")
    finally:
        stop.set()
        t.join()
