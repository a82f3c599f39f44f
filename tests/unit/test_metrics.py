"""MetricsLogger (JSONL, console table, wandb) and the plot command, on hand-written metrics."""

import io
import json
import math
import re
import subprocess
import sys
import time
import types

import pytest
import torch
from rich.console import Console

from colocate import metrics as metrics_mod
from colocate.metrics import MetricsLogger, read_metrics, run_summary
from colocate.plot import _draw_startup, collect_series, latest_startup, merge_by_step, plot
from colocate.plot import main as plot_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _logger(path, console=False, **kw):
    kw = {"enabled": True, "use_wandb": False, "wandb_project": "test", **kw}
    return MetricsLogger(path, console=console, **kw)


def _clean_wandb_env(monkeypatch, tmp_path):
    """No API key, no netrc, no user-set mode: the logger alone decides the wandb mode."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))


def test_log_writes_one_exact_json_line_per_step(tmp_path):
    logger = _logger(tmp_path / "run")
    steps = [
        {"rollout/raw_reward": torch.tensor(0.25), "train/ppo_kl": 1e-3, "rollout/num_dropped": 2},
        {"rollout/raw_reward": 0.5, "train/ppo_kl": float("nan"), "train/grad_norm": float("inf")},
        {"rollout/raw_reward": torch.tensor([0.75], dtype=torch.float64), "eval/raw_reward": 0.125},
    ]
    before = time.time()
    for step, values in enumerate(steps):
        logger.log(step, values)
    logger.close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    records = [json.loads(line) for line in lines]
    for record in records:
        assert before - 1 <= record.pop("time") <= time.time() + 1
    assert records == [
        {"step": 0, "rollout/raw_reward": 0.25, "train/ppo_kl": 1e-3, "rollout/num_dropped": 2},
        {"step": 1, "rollout/raw_reward": 0.5, "train/ppo_kl": None, "train/grad_norm": None},
        {"step": 2, "rollout/raw_reward": 0.75, "eval/raw_reward": 0.125},
    ]
    assert isinstance(records[0]["rollout/num_dropped"], int)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2]


def test_each_line_is_on_disk_before_the_next_log(tmp_path):
    logger = _logger(tmp_path)
    logger.log(0, {"x": 1.0})
    assert read_metrics(tmp_path)[0]["x"] == 1.0


def test_bad_metric_values_name_the_key(tmp_path):
    logger = _logger(tmp_path)
    with pytest.raises(ValueError, match="'train/loss'.*shape \\(2,\\)"):
        logger.log(0, {"train/loss": torch.ones(2)})
    with pytest.raises(ValueError, match="'note'.*str"):
        logger.log(0, {"note": "hello"})
    with pytest.raises(ValueError, match="'step' is reserved"):
        logger.log(0, {"step": 3})


def test_non_main_logger_writes_and_prints_nothing(tmp_path):
    buf = io.StringIO()
    logger = MetricsLogger(
        tmp_path / "run",
        enabled=False,
        use_wandb=True,
        wandb_project="test",
        config={"lr": 1.0},
        console=Console(file=buf, force_terminal=True),
    )
    logger.log(0, {"rollout/raw_reward": 1.0})
    logger.info("hello")
    logger.warning("careful")
    with logger.progress(3, "generate") as bar:
        bar.advance(3)
    logger.close()
    assert not (tmp_path / "run").exists()
    assert buf.getvalue() == ""


def test_console_prints_header_once_and_one_row_per_step(tmp_path):
    buf = io.StringIO()
    logger = _logger(tmp_path, console=Console(file=buf, width=100))
    logger.log(
        7,
        {
            "rollout/raw_reward": 0.625,
            "perf/generate_time": 2.0,
            "perf/train_time": 1.5,
            "perf/actor_train_time": 1.2,
            "perf/to_train_time": 0.25,
            "perf/to_rollout_time": 0.5,
            "perf/step_time": 4.5,
            "memory/generate/allocated_gib": 30.0,
            "memory/generate/device_used_gib": 10.0,
            "memory/train/device_used_gib": 20.5,
        },
    )
    logger.log(
        8,
        {
            "rollout/raw_reward": 0.75,
            "train/grad_norm": 12345.678,
            "eval/toy/avg@4": 0.25,
            "eval/other/avg@4": 0.5,
            "perf/step_time": 9.0,
            "perf/train_time": 4.0,
        },
    )
    lines = buf.getvalue().splitlines()
    assert sum(line.split()[:2] == ["step", "reward"] for line in lines) == 1
    rows = {line.split()[0]: line.split() for line in lines if line.split()[0].isdigit()}
    # step reward len kl clip entropy gnorm gen_s train_s move_s step_s GiB eval: the step's wall
    # clock as measured (not a sum of nested phases), device memory in use (not torch's allocated)
    assert rows["7"] == ["7", "0.625", "-", "-", "-", "-", "-", "2", "1.5", "0.75", "4.5", "20.5", "-"]
    assert rows["8"] == ["8", "0.75", "-", "-", "-", "-", "12346", "-", "4", "-", "9", "-", "0.375"]
    assert max(len(line) for line in lines) <= 100


def test_info_and_warning_go_to_console_and_log_file(tmp_path):
    buf = io.StringIO()
    logger = _logger(tmp_path, console=Console(file=buf, width=100))
    logger.info("loaded 12 prompts")
    logger.warning("3 prompts too long")
    assert buf.getvalue().splitlines() == ["loaded 12 prompts", "warning: 3 prompts too long"]
    log = (tmp_path / "log.txt").read_text().splitlines()
    assert log[0].endswith(" INFO loaded 12 prompts") and log[1].endswith(" WARNING 3 prompts too long")


def test_progress_bar_counts_to_total(tmp_path):
    buf = io.StringIO()
    logger = _logger(tmp_path, console=Console(file=buf, width=100, force_terminal=True))
    with logger.progress(10, "generate") as bar:
        for _ in range(4):
            bar.advance(2)
        bar.advance()
        bar.advance()
    assert "generate" in buf.getvalue() and "10/10" in buf.getvalue()


def test_wandb_disabled_never_imports_wandb(tmp_path):
    code = (
        "import sys\n"
        "from colocate.metrics import MetricsLogger\n"
        f"lg = MetricsLogger({str(tmp_path)!r}, enabled=True, use_wandb=False, wandb_project='p',\n"
        "                   console=False)\n"
        "lg.log(0, {'x': 1.0}); lg.info('hi'); lg.close()\n"
        "assert 'wandb' not in sys.modules, 'wandb was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert read_metrics(tmp_path)[0]["x"] == 1.0


def test_wandb_mode_follows_key_netrc_and_user_setting(monkeypatch, tmp_path):
    _clean_wandb_env(monkeypatch, tmp_path)
    assert metrics_mod._wandb_mode() == "offline"
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine example.com login user password secret\n")
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert metrics_mod._wandb_mode() == "offline"
    netrc_file.write_text("machine api.wandb.ai login user password fake-key\n")
    assert metrics_mod._wandb_mode() == "online"
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    monkeypatch.setenv("WANDB_API_KEY", "fake-key")
    assert metrics_mod._wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert metrics_mod._wandb_mode() == "disabled"


class _FakeRun:
    def __init__(self, fail_log):
        self.logged, self.finished, self.fail_log = [], False, fail_log

    def log(self, values, step):
        if self.fail_log:
            raise ConnectionError("network down")
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


def _fake_wandb(monkeypatch, fail_init=False, fail_log=False):
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        if fail_init:
            raise RuntimeError("no service")
        return _FakeRun(fail_log)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    return calls


def test_wandb_gets_values_and_run_id_is_reused_on_resume(monkeypatch, tmp_path):
    _clean_wandb_env(monkeypatch, tmp_path)
    calls = _fake_wandb(monkeypatch)
    logger = _logger(tmp_path / "run", use_wandb=True, run_name="r1", config={"lr": 1e-6})
    run = logger._wandb_run
    logger.log(3, {"train/ppo_kl": torch.tensor(0.5), "train/grad_norm": float("nan"), "eval/raw_reward": None})
    logger.close()
    assert run.finished and len(run.logged) == 1
    step, values = run.logged[0]
    assert step == 3 and values["train/ppo_kl"] == 0.5 and math.isnan(values["train/grad_norm"])
    assert "eval/raw_reward" not in values
    first = calls[0]
    assert first["mode"] == "offline" and first["resume"] == "allow"
    assert first["dir"] == str(tmp_path / "run")
    assert first["project"] == "test" and first["name"] == "r1" and first["config"] == {"lr": 1e-6}
    assert (tmp_path / "run" / "wandb_run_id.txt").read_text().strip() == first["id"]
    _logger(tmp_path / "run", use_wandb=True).close()
    assert calls[1]["id"] == first["id"]
    _logger(tmp_path / "other", use_wandb=True).close()
    assert calls[2]["id"] != first["id"]


@pytest.mark.parametrize("fail_init", [True, False])
def test_wandb_failure_warns_once_and_logging_continues(monkeypatch, tmp_path, fail_init):
    _fake_wandb(monkeypatch, fail_init=fail_init, fail_log=not fail_init)
    buf = io.StringIO()
    logger = _logger(tmp_path, use_wandb=True, console=Console(file=buf, width=200))
    for step in range(3):
        logger.log(step, {"rollout/raw_reward": float(step)})
    logger.close()
    warnings = [line for line in buf.getvalue().splitlines() if line.startswith("warning: wandb")]
    assert len(warnings) == 1 and ("no service" if fail_init else "network down") in warnings[0]
    assert [r["rollout/raw_reward"] for r in read_metrics(tmp_path)] == [0.0, 1.0, 2.0]


def test_real_wandb_offline_run_and_resume(monkeypatch, tmp_path):
    _clean_wandb_env(monkeypatch, tmp_path)
    out = tmp_path / "run"
    logger = _logger(out, use_wandb=True, config={"lr": 1e-6})
    run = logger._wandb_run
    assert run is not None and run.settings.mode == "offline" and run.config["lr"] == 1e-6
    logger.log(0, {"rollout/raw_reward": torch.tensor(0.5), "train/ppo_kl": float("nan")})
    logger.log(1, {"rollout/raw_reward": 0.75})
    assert logger._wandb_run is run
    logger.close()
    run_id = (out / "wandb_run_id.txt").read_text().strip()
    assert run.id == run_id
    _logger(out, use_wandb=True).close()
    run_dirs = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    # offline-run-<time>-<id>, with "-1" appended when both runs started within the same second
    pattern = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?")
    assert len(run_dirs) == 2 and all(pattern.fullmatch(name) for name in run_dirs), run_dirs


def test_read_metrics_skips_a_torn_last_line_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "x": 1}\n{"step": 1, "x"')
    assert read_metrics(tmp_path) == [{"step": 0, "x": 1}]
    path.write_text('{"step": 0, "x": 1}\n{"step": 1, "x"\n{"step": 2, "x": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(tmp_path)


def test_merge_by_step_later_records_win():
    records = [{"step": 1, "a": 1.0}, {"step": 0, "a": 0.0}, {"step": 1, "b": 2.0}, {"step": 1, "a": 5.0}]
    assert merge_by_step(records) == {0: {"step": 0, "a": 0.0}, 1: {"step": 1, "a": 5.0, "b": 2.0}}


def test_plot_writes_one_png_per_group(tmp_path, capsys):
    logger = _logger(tmp_path)
    for step in range(4):
        logger.log(
            step,
            {
                "rollout/raw_reward": 0.1 * step,
                "train/ppo_kl": 0.01 * step,
                "train/entropy_loss": float("nan"),
                "perf/generate_time": 1.0 + step,
                "perf/train_time": 2.0,
                "memory/after_train/allocated_gib": 3.0,
                "memory/after_generate/allocated_gib": 4.0,
                "rollout/epoch": 0,
                **({"eval/raw_reward": 0.5 + step} if step % 2 == 0 else {}),
            },
        )
    assert plot_main([str(tmp_path)]) == 0
    names = {"rollout", "train", "eval", "perf"}  # memory and rollout/epoch never change: left out
    series = collect_series(merge_by_step(read_metrics(tmp_path)))
    assert set(series["rollout"]) == {"rollout/raw_reward"} and set(series["perf"]) == {"perf/generate_time"}
    assert set(collect_series(merge_by_step(read_metrics(tmp_path)), ["rollout/*"])["rollout"]) == {
        "rollout/raw_reward",
        "rollout/epoch",
    }  # asked for by name: drawn even when flat
    expected = [str(tmp_path / "plots" / f"{n}.png") for n in sorted(names)]
    assert capsys.readouterr().out.split() == expected
    for name in names:
        assert (tmp_path / "plots" / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
    paths = plot(tmp_path, tmp_path / "only", keys=["train/entropy_loss", "eval/*"])
    assert paths == [tmp_path / "only" / "eval.png"]


STARTUP = {
    "perf/startup/process_s": 3.25,
    "perf/startup/inputs_s": 9.0,
    "perf/startup/engine_s": 4.0,
    "perf/startup/engine_cuda_graphs_s": 2.5,
    "perf/startup/first_sync_s": 0.25,
}


def test_plot_draws_the_start_up_as_one_bar_chart_in_perf(tmp_path, capsys):
    logger = _logger(tmp_path)
    for step in range(3):
        logger.log(step, {"perf/train_time": 2.0 + step, **(STARTUP if step == 0 else {})})
    steps = merge_by_step(read_metrics(tmp_path))
    assert set(collect_series(steps)["perf"]) == {"perf/train_time"}  # no single-dot panel per part
    assert latest_startup(steps) == (
        0,
        {"process": 3.25, "inputs": 9.0, "engine": 4.0, "engine_cuda_graphs": 2.5, "first_sync": 0.25},
    )
    assert latest_startup(steps, ["perf/startup/e*"]) == (0, {"engine": 4.0, "engine_cuda_graphs": 2.5})
    assert latest_startup(steps, ["perf/train_time"]) is None
    assert plot(tmp_path, tmp_path / "only", keys=["perf/startup/*"]) == [tmp_path / "only" / "perf.png"]
    logger.log(3, {**STARTUP, "perf/startup/inputs_s": 1.0})  # a resumed run's own start-up
    assert latest_startup(merge_by_step(read_metrics(tmp_path)))[0] == 3

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    _draw_startup(ax, *latest_startup(steps))
    assert [t.get_text() for t in ax.get_yticklabels()] == ["process", "inputs", "engine", "cuda graphs", "first sync"]
    assert [bar.get_width() for bar in ax.patches] == [3.25, 9.0, 4.0, 2.5, 0.25]
    assert ax.get_title() == "start-up 16.5 s (step 0)"  # the top-level parts; cuda graphs is inside engine
    plt.close(fig)


def test_plot_names_the_line_of_a_record_without_a_step(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "a": 1.0}\n\n{"a": 2.0}\n{"step": 2, "a": 3.0}\n')
    assert plot_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == f'error: {path}:3: a metrics record needs an integer "step"\n'
    path.write_text('{"step": 0, "a": 1.0}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: a metrics record"):
        plot(tmp_path)
    assert not (tmp_path / "plots").exists()


def test_plot_errors_on_missing_or_empty_file(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot(tmp_path)
    assert plot_main([str(tmp_path)]) == 2
    assert "no metrics file" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no records"):
        plot(tmp_path)
    assert not (tmp_path / "plots").exists()


def test_run_summary_reads_the_runs_metrics(tmp_path):
    logger = _logger(tmp_path)
    for step in range(10):
        logger.log(step, {"rollout/raw_reward": step / 10, **({"eval/toy/avg@1": step / 20} if step % 3 == 0 else {})})
    assert run_summary(tmp_path, 12.34).splitlines() == [
        "10 steps in 12.3 s",
        "reward 0.050 (first fifth of the steps) -> 0.850 (last fifth)",
        "eval/toy/avg@1 0.000 -> 0.450",
        f"outputs in {tmp_path} (metrics.jsonl; `./launch.sh plot {tmp_path}` draws them)",
    ]


def test_a_resumed_runs_summary_counts_only_the_steps_it_ran(tmp_path):
    earlier = time.time() - 3600  # the run that wrote steps 0-6 and saved a checkpoint after step 4
    lines = [{"step": s, "time": earlier + s, "rollout/raw_reward": 0.0} for s in range(7)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    logger = _logger(tmp_path)
    logger.log(4, {"rollout/raw_reward": 0.0, "resume/record_from_checkpoint": 1})  # restored, not run
    assert run_summary(tmp_path, 60.0).splitlines()[0] == "no steps of this run in 60.0 s (0-6 earlier)"
    for step in range(5, 10):
        logger.log(step, {"rollout/raw_reward": 1.0})
    summary = run_summary(tmp_path, 60.0).splitlines()
    assert summary[0] == "steps 5-9 of this run in 60.0 s (0-4 earlier)"
    assert summary[1] == "reward 0.000 (first fifth of the steps) -> 1.000 (last fifth)"  # the whole training


def test_a_failed_metrics_write_is_one_error_naming_the_file(tmp_path, capsys):
    from colocate.cli import entry_point

    logger = _logger(tmp_path)
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    with pytest.raises(OSError) as info:
        logger.log(1, {"rollout/raw_reward": 0.5})
    assert str(info.value) == f"cannot write {tmp_path / 'metrics.jsonl'}: No space left on device"
    assert entry_point(lambda argv: logger.log(2, {}))([]) == 2
    assert capsys.readouterr().err == f"error: cannot write {tmp_path / 'metrics.jsonl'}: No space left on device\n"
    (tmp_path / "log.txt").symlink_to("/dev/full")
    with pytest.raises(OSError, match=f"^cannot write {tmp_path / 'log.txt'}: No space left on device$"):
        logger.info("a message")
