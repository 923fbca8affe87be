"""Download folders: each server keeps its own, so that two servers on one machine (a test session's
several, or a second copy of the app) never remove each other's files; a folder of a server that has
ended goes when the next one starts; a pre-computed study's files live outside the rotated folders."""
import os
import subprocess
import sys

from nctv.ui import common


def test_a_server_rotates_only_its_own_downloads_and_clears_those_of_ended_servers(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "_EXPORT_ROOT", tmp_path)
    common._exports_root.cache_clear()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / ended.stdout.strip()
    (gone / "calibration-x").mkdir(parents=True)
    alive = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        other = tmp_path / str(alive.pid) / "calibration-y"
        other.mkdir(parents=True)
        (other / "results.json").write_text("{}")
        made = [common.export_dir("calibration") for _ in range(common.KEEP_EXPORTS + 5)]
        assert not gone.exists()  # that server has ended
        assert (other / "results.json").read_text() == "{}"  # a running server's download stays
        mine = tmp_path / str(os.getpid())
        assert all(p.parent == mine for p in made)
        kept = sorted(p.name for p in mine.iterdir())
        assert kept == sorted(p.name for p in made[-common.KEEP_EXPORTS:])
    finally:
        alive.communicate(b"")
        common._exports_root.cache_clear()


def test_the_shipped_shift_studys_table_outlives_the_rotated_downloads(tmp_path, monkeypatch):
    from pathlib import Path

    from nctv.ui import shift

    monkeypatch.setattr(common, "_EXPORT_ROOT", tmp_path)
    common._exports_root.cache_clear()
    try:
        status, table, versus, files = shift.shipped_view()
        csv = next(f for f in files if f.endswith("table.csv"))
        for _ in range(common.KEEP_EXPORTS + 1):
            common.export_dir("calibration")
        assert Path(csv).read_text(encoding="utf-8").splitlines()[0].count(",") >= 2
        assert shift.shipped_view()[3] == files
    finally:
        common._exports_root.cache_clear()
