"""The metrics directory ``hardcount/gunicorn.conf.py`` sets up for prometheus_client's multiprocess mode.

docs/decisions/0126-metrics-one-truth-per-scrape.md: each gunicorn run gets a fresh directory
of its own, kept when the configuration is read again (SIGHUP), removed when the master exits;
those of masters that are gone are removed at the next start; one named in the environment is
used as it is.
"""

import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

CONF = str(Path(__file__).resolve().parents[2] / "hardcount" / "gunicorn.conf.py")
ENV = ("PROMETHEUS_MULTIPROC_DIR", "HARDCOUNT_METRICS_DIR_OWNER")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in ENV:
        monkeypatch.setenv(name, "placeholder")  # so the fixture's undo restores the real value, whatever the conf sets
        monkeypatch.delenv(name)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def read_conf() -> dict:
    return runpy.run_path(CONF)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_run_gets_a_fresh_directory_kept_on_reload_and_removed_on_exit(tmp_path):
    conf = read_conf()
    path = conf["_owned_metrics_dir"]
    assert os.path.dirname(path) == str(tmp_path)
    assert os.path.basename(path).startswith(f"hardcount-metrics-{os.getpid()}-")
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == path
    assert os.listdir(path) == []

    again = read_conf()  # SIGHUP: gunicorn reads its configuration again in the same master
    assert again["_owned_metrics_dir"] == path
    assert os.path.isdir(path)

    again["on_exit"](None)
    assert not os.path.exists(path)


def test_directories_of_masters_that_are_gone_are_removed_and_live_ones_kept(tmp_path):
    stale = tmp_path / f"hardcount-metrics-{dead_pid()}-abcd"
    stale.mkdir()
    (stale / "counter_1.db").write_bytes(b"x")
    alive = tmp_path / f"hardcount-metrics-{os.getppid()}-efgh"
    alive.mkdir()
    other = tmp_path / "something-else"
    other.mkdir()

    path = read_conf()["_owned_metrics_dir"]
    assert not stale.exists()
    assert alive.exists() and other.exists() and os.path.isdir(path)


def test_a_directory_named_in_the_environment_is_used_as_it_is(tmp_path, monkeypatch):
    given = tmp_path / "operator" / "metrics"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(given))
    conf = read_conf()
    assert conf["_owned_metrics_dir"] is None
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(given)
    assert given.is_dir()
    conf["on_exit"](None)
    assert given.is_dir()  # the operator's, not removed


def test_a_new_master_that_inherited_another_masters_directory_makes_its_own(tmp_path, monkeypatch):
    inherited = tmp_path / "hardcount-metrics-1-old"
    inherited.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(inherited))
    monkeypatch.setenv("HARDCOUNT_METRICS_DIR_OWNER", f"1:{inherited}")  # a USR2 re-exec: the old master's
    path = read_conf()["_owned_metrics_dir"]
    assert path != str(inherited)
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == path
    assert inherited.exists()  # pid 1 is alive: its directory is its own to remove
