"""`python -m kernelgen`: --version, unknown commands, argument errors reported by argparse (exit 2, no
traceback), `db merge` with a missing or broken file, `cache info` in human units and as JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import kernelgen
from kernelgen.__main__ import main
from kernelgen.tuning import database


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kernelgen {kernelgen.__version__}"


def test_unknown_command_is_a_usage_error(capsys):
    assert main(["foo"]) == 2
    out, err = capsys.readouterr()
    assert not out
    assert err.startswith("python -m kernelgen: unknown command 'foo'\n")
    assert "usage: python -m kernelgen" in err and "cache" in err


def test_settings_command_lists_every_setting_and_names_a_bad_environment_value(capsys, monkeypatch):
    from kernelgen import settings
    assert main(["settings"]) == 0
    out = capsys.readouterr().out
    for s in settings.SETTINGS.values():
        assert s.name in out and (s.env is None or s.env in out)
    monkeypatch.setenv("KERNELGEN_INDEX32", "maybe")
    assert main(["settings"]) == 2
    assert "KERNELGEN_INDEX32" in capsys.readouterr().err


def test_help_lists_the_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--version" in out and all(name in out for name in ("demo", "cache", "db"))


@pytest.mark.parametrize("size, message", [("1,2,3", "five comma-separated integers"),
                                           ("1,2,x,4,5", "five comma-separated integers"),
                                           ("1,2,3,4,0", "at least 1"),
                                           ("1000,1000,1000,1000,1", "the demo allows")])
def test_demo_size_is_checked_by_argparse(capsys, size, message):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--size", size])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --size" in err and message in err


def test_demo_bad_size_shows_no_traceback():
    """It used to be a ValueError traceback from unpacking `map(int, ...)`."""
    run = subprocess.run([sys.executable, "-m", "kernelgen", "demo", "--size", "1,2,3"], capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr and "N,H,W,C,K" in run.stderr


def test_demo_cuda_without_a_gpu_is_a_usage_error(capsys):
    from kernelgen.api import gpu_present
    if gpu_present():
        pytest.skip("a GPU is visible: --backend cuda would run the demo")
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--backend", "cuda"])
    assert exit_.value.code == 2 and "no CUDA GPU" in capsys.readouterr().err


def test_db_merge_names_a_missing_file_and_writes_nothing(tmp_path, capsys):
    """A missing TUNED file used to be reported as "holds no database entries", with a traceback."""
    into = tmp_path / "shipped.json"
    assert main(["db", "merge", str(tmp_path / "missing.json"), "--into", str(into)]) == 2
    err = capsys.readouterr().err
    assert "missing.json does not exist" in err and "Traceback" not in err
    assert not into.exists() and os.listdir(tmp_path) == []


@pytest.mark.parametrize("text", ["not json, maybe the user's notes", '{"my": "settings"}'])
def test_db_merge_refuses_to_overwrite_a_file_that_is_no_database(tmp_path, capsys, text):
    """JSON that is no database used to be replaced by the merged entries alone."""
    tuned, into = tmp_path / "tuned.json", tmp_path / "shipped.json"
    database.save(tuned, {"a": {"ms": 1.0}}, "dev")
    into.write_text(text)
    assert main(["db", "merge", str(tuned), "--into", str(into)]) == 2
    assert "shipped.json holds no database entries" in capsys.readouterr().err
    assert into.read_text() == text
    assert sorted(os.listdir(tmp_path)) == ["shipped.json", "tuned.json"]


def test_db_merge_into_a_new_file(tmp_path, capsys):
    tuned, into = tmp_path / "tuned.json", tmp_path / "new.json"
    database.save(tuned, {"a": {"ms": 1.0}}, "dev")
    assert main(["db", "merge", str(tuned), "--into", str(into)]) == 0
    assert database.load(into) == {"a": {"ms": 1.0}} and json.loads(into.read_text())["device"] == "dev"
    assert "1 entries" in capsys.readouterr().out


def test_db_merge_precision_is_checked_by_argparse(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["db", "merge", str(tmp_path / "t.json"), "--into", str(tmp_path / "i.json"), "--precision", "fp8"])
    assert exit_.value.code == 2 and "--precision" in capsys.readouterr().err


def test_cache_info_in_human_units_and_json(tmp_path, monkeypatch, capsys):
    from kernelgen.runtime.cache import KernelCache
    KernelCache(root=tmp_path).get(("cli-info", 0), lambda: "X = 0\n" + "# padding\n" * 200)
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KERNELGEN_CACHE_MAX_BYTES", "512M")
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert f"directory  {tmp_path}" in out and "entries    1 (2.0 KiB)" in out and "limit      512.0 MiB" in out
    assert main(["cache", "info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"directory", "entries", "bytes", "memory_entries", "memory_hits", "disk_hits", "misses", "corrupt",
            "lifetime", "max_bytes"} <= set(data)
    assert data["entries"] == 1 and data["max_bytes"] == 512 << 20 and data["bytes"] > 2000


def test_cache_info_with_a_bad_bound_is_an_error_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KERNELGEN_CACHE_MAX_BYTES", "lots")
    assert main(["cache", "info"]) == 2
    assert "KERNELGEN_CACHE_MAX_BYTES" in capsys.readouterr().err
