"""The one command (`colocate COMMAND ...`, colocate/__main__.py) and launch.sh's --help."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from colocate import __main__ as command

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_help_lists_every_command_on_a_line_of_its_own():
    done = run(sys.executable, "-m", "colocate", "--help")
    assert done.returncode == 0 and done.stderr == ""
    lines = done.stdout.splitlines()
    assert lines[0] == "usage: colocate COMMAND [ARGS...]"
    listed = [line.split()[0] for line in lines if line.startswith("  ")]
    assert listed == ["train", "generate", "export", "parity", "plot", "data", "toy"]
    for name in listed:  # each is a module with an entry point
        assert callable(importlib.import_module(f"colocate.{name}").main)


def test_an_unknown_command_is_one_line_naming_them_all(capsys):
    assert command.main(["trian", "--config", "x.yaml"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        "error: unknown command 'trian'; choose one of train, generate, export, parity, plot, data, toy (colocate --help)\n"
    )
    assert command.main([]) == 2
    assert capsys.readouterr().err.startswith("usage: colocate COMMAND")


@pytest.fixture(autouse=True)
def _argv(monkeypatch):
    """The dispatcher names the command in sys.argv (what tyro's usage line prints): put it back."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))


def test_a_command_runs_its_tools_main_with_the_rest(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "perf/train_time": 1.5}\n{"step": 1, "perf/train_time": 2.0}\n')
    assert command.main(["plot", str(tmp_path), "--out", str(tmp_path / "png")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'png' / 'perf.png'}\n"
    assert command.main(["plot", str(tmp_path / "none")]) == 2  # the tool's own one-line error
    assert capsys.readouterr().err == f"error: no metrics file at {tmp_path / 'none' / 'metrics.jsonl'}\n"
    with pytest.raises(SystemExit) as done:
        command.main(["export", "--help"])
    assert done.value.code == 0 and "usage: python -m colocate.export" in capsys.readouterr().out


def test_train_ends_the_process_as_python_m_colocate_train_does(monkeypatch):
    from colocate import dist, train

    seen = []
    monkeypatch.setattr(train, "main", lambda argv: seen.append(argv) or 2)
    monkeypatch.setattr(dist, "exit_process", seen.append)
    command.main(["train", "--config", "x.yaml"])
    assert seen == [["--config", "x.yaml"], 2]


def test_train_help_names_the_command(capsys):
    with pytest.raises(SystemExit) as done:
        command.main(["train", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("usage: colocate train ")
    assert "--overwrite, --no-overwrite" in out


def test_the_console_script_is_the_dispatcher():
    try:
        (entry,) = importlib.metadata.entry_points(group="console_scripts", name="colocate")
    except ValueError:
        pytest.skip("colocate is installed without its console script (pip install -e . installs it)")
    assert entry.value == "colocate.__main__:main"


def test_launch_help_prints_the_usage_without_setting_up(tmp_path):
    done = run(str(ROOT / "launch.sh"), "--help", cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("colocate launcher.\n")
    for usage in ("./launch.sh COMMAND [ARGS...]", "./launch.sh test [PYTEST ARGS...]", "./launch.sh test --all"):
        assert usage in done.stdout
    assert "#" not in done.stdout and "set -e" not in done.stdout
    assert run(str(ROOT / "launch.sh"), "-h").stdout == done.stdout
