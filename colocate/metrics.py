"""One `log(step, dict)` for the training loop: JSONL on disk, wandb, and a rich console table.

Only rank 0 logs. Other ranks build the same object with `enabled=False`, so the loop calls it
unconditionally and nothing is written or printed twice. The JSONL file is the source of truth
(tests and `colocate.plot` read it); each line is flushed when written, so a killed run keeps every
finished step. wandb is optional and never fatal: a failure is reported once and logging continues
without it.
"""

from __future__ import annotations

import contextlib
import json
import math
import netrc
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

METRICS_FILE = "metrics.jsonl"
LOG_FILE = "log.txt"
WANDB_ID_FILE = "wandb_run_id.txt"


def _values(m: dict[str, Any], prefix: str, suffix: str) -> list[float]:
    return [v for k, v in m.items() if k.startswith(prefix) and k.endswith(suffix) and v is not None]


def _handoff_seconds(m: dict[str, Any]) -> float | None:
    """Seconds of the step's two memory switches (to_train and to_rollout)."""
    values = [m[k] for k in ("perf/to_train_time", "perf/to_rollout_time") if m.get(k) is not None]
    return sum(values) if values else None


def _device_memory(m: dict[str, Any]) -> float | None:
    """The most device memory in use at any phase end of the step (`memory/<phase>/device_used_gib`:
    what the device reports, so paused torch_memory_saver regions do not count)."""
    values = _values(m, "memory/", "device_used_gib")
    return max(values) if values else None


def _eval_reward(m: dict[str, Any]) -> float | None:
    """Mean over eval datasets of their average reward (`eval/<dataset>/avg@k`) in the step."""
    values = [v for k, v in m.items() if k.startswith("eval/") and "/avg@" in k and v is not None]
    return sum(values) / len(values) if values else None


# (header, width, value of the step's metrics). Widths plus one space each stay under 100 columns.
_COLUMNS = (
    ("reward", 7, lambda m: m.get("rollout/raw_reward")),
    ("len", 6, lambda m: m.get("rollout/response_len/mean")),
    ("kl", 8, lambda m: m.get("train/ppo_kl")),
    ("clip", 6, lambda m: m.get("train/pg_clipfrac")),
    ("entropy", 7, lambda m: m.get("train/entropy_loss")),
    ("gnorm", 7, lambda m: m.get("train/grad_norm")),
    ("gen s", 6, lambda m: m.get("perf/generate_time")),
    ("train s", 7, lambda m: m.get("perf/train_time")),
    ("move s", 6, _handoff_seconds),
    ("step s", 6, lambda m: m.get("perf/step_time")),
    ("GiB", 6, _device_memory),
    ("eval", 7, _eval_reward),
)
_STEP_WIDTH = 6
_LEGEND = "len=response_len  move=to_train+to_rollout  GiB=max device used  eval=mean eval/*/avg@k"


def _fmt(value: Any, width: int) -> str:
    """The shortest-precision text of `value` that fits `width` (4 significant digits at most)."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "nan"
    candidates = [f"{value:.4g}", f"{value:.0f}" if abs(value) >= 1 else ""]
    candidates += [f"{value:.{digits}g}" for digits in (3, 2, 1)]
    return next((text for text in candidates if text and len(text) <= width), candidates[-1])


def _to_number(key: str, value: Any) -> int | float | None:
    """A plain Python number from a float, int, bool, None, or one-element tensor/array."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if hasattr(value, "item"):
        try:
            return value.item()
        except (RuntimeError, ValueError) as err:
            shape = tuple(value.shape)
            raise ValueError(f"metric {key!r} must be a scalar, got a value of shape {shape}") from err
    kind = type(value).__name__
    raise ValueError(f"metric {key!r} must be a number or a one-element tensor, got {kind}")


def _json_safe(value: int | float | None) -> int | float | None:
    """JSON has no NaN or infinity: non-finite floats are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def plain_metrics(metrics: dict[str, Any]) -> dict[str, int | float | None]:
    """The metrics as JSON numbers (tensors read, non-finite floats null), e.g. for a checkpoint."""
    return {key: _json_safe(_to_number(key, value)) for key, value in metrics.items()}


def startup_phases(record: dict[str, Any]) -> dict[str, float]:
    """The `perf/startup/<part>_s` values of a record (the first step's), keyed by part."""
    prefix, suffix = "perf/startup/", "_s"
    return {k[len(prefix) : -len(suffix)]: v for k, v in record.items() if k.startswith(prefix)}


def split_startup(parts: dict[str, float]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(top-level parts, {part: its sub-parts}) of `startup_phases`' result: `engine_cuda_graphs` is
    the sub-part `cuda_graphs` of `engine` when `engine` is a part itself (`first_sync` is not a
    sub-part: there is no part `first`). The top-level parts add up to the start-up."""
    top: dict[str, float] = {}
    subs: dict[str, dict[str, float]] = {}
    for key, seconds in parts.items():
        head, _, rest = key.partition("_")
        if rest and head in parts:
            subs.setdefault(head, {})[rest] = seconds
        else:
            top[key] = seconds
    return top, subs


def startup_line(parts: dict[str, float]) -> str:
    """'start-up 4.4 s: process 1.9, inputs 1.2, trainer 0.5 (actor 0.4), ..., first sync 0.0' from
    parts as `startup_phases` gives them: the top-level ones, which add up, with their sub-parts."""
    top, subs = split_startup(parts)

    def part(name: str, seconds: float) -> str:
        inner = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in subs.get(name, {}).items())
        return f"{name.replace('_', ' ')} {seconds:.1f}" + (f" ({inner})" if inner else "")

    return f"start-up {sum(top.values()):.1f} s: " + ", ".join(part(k, v) for k, v in top.items())


def logged_steps(output_dir: str | os.PathLike) -> set[int]:
    """Steps with a record in OUTPUT_DIR/metrics.jsonl (none when there is no file yet)."""
    try:
        return {r["step"] for r in read_metrics(output_dir)}
    except FileNotFoundError:
        return set()


def _wandb_mode() -> str:
    """`WANDB_MODE` when the user set it; else online if an API key is known, offline if not.

    A key is known from `WANDB_API_KEY` or from a netrc entry for the wandb host (`wandb login`
    writes one). Offline runs keep everything under the output directory for a later `wandb sync`.
    """
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        entry = netrc.netrc(path).authenticators(host) if path.is_file() else None
    except (OSError, netrc.NetrcParseError):
        entry = None
    return "online" if entry and entry[2] else "offline"


class _NoProgress:
    def advance(self, n: int = 1) -> None:
        pass


class _Progress:
    def __init__(self, progress: Progress, task: int):
        self._progress, self._task = progress, task

    def advance(self, n: int = 1) -> None:
        self._progress.advance(self._task, n)


class MetricsLogger:
    """Rank-0 logging behind one object; with `enabled=False` every method does nothing.

    `console` is True for the terminal, False for no console output (files and wandb only), or a
    rich Console to print to (a notebook, or a Console(file=StringIO()) in a test).
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        *,
        enabled: bool,
        use_wandb: bool,
        wandb_project: str,
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
        console: bool | Console = True,
    ):
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        self._console: Console | None = None
        self._header_printed = False
        self._wandb_run = None
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._console = console if isinstance(console, Console) else (Console() if console else None)
        if use_wandb:
            self._init_wandb(wandb_project, run_name, config or {})

    def _init_wandb(self, project: str, run_name: str | None, config: dict[str, Any]) -> None:
        """Start (or resume) the wandb run; the run id lives in the output directory for resumes."""
        id_file = self.output_dir / WANDB_ID_FILE
        run_id = (id_file.read_text().strip() if id_file.is_file() else "") or uuid.uuid4().hex[:12]
        try:
            import wandb

            self._wandb_run = wandb.init(
                project=project,
                name=run_name,
                config=config,
                dir=str(self.output_dir),
                id=run_id,
                resume="allow",
                mode=_wandb_mode(),
            )
        except Exception as err:  # noqa: BLE001 - a logging backend must never stop training
            self._wandb_failed("could not start", err)
            return
        id_file.write_text(run_id + "\n")

    def _wandb_failed(self, what: str, err: Exception) -> None:
        self._wandb_run = None
        self.warning(f"wandb {what} ({type(err).__name__}: {err}); continuing without wandb")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one JSON line, send to wandb, print one table row.

        Tensors become floats (one host sync each: pass values already on the host where it matters).
        NaN and infinity are null in the file and NaN/inf in wandb.
        """
        if not self.enabled:
            return
        values = {key: _to_number(key, value) for key, value in metrics.items()}
        for reserved in ("step", "time"):
            if reserved in values:
                raise ValueError(f"metric name {reserved!r} is reserved for the record's own field")
        record = {"step": step, "time": round(time.time(), 3)}
        record.update((key, _json_safe(value)) for key, value in values.items())
        self._append(METRICS_FILE, json.dumps(record) + "\n")
        if self._wandb_run is not None:
            try:
                self._wandb_run.log({k: v for k, v in values.items() if v is not None}, step=step)
            except Exception as err:  # noqa: BLE001
                self._wandb_failed("logging failed", err)
        if self._console is not None:
            self._print_row(step, values)

    def _print_row(self, step: int, values: dict[str, Any]) -> None:
        if not self._header_printed:
            header = Text("step".rjust(_STEP_WIDTH), style="bold")
            for name, width, _ in _COLUMNS:
                header.append(" " + name.rjust(width), style="bold")
            self._console.print(header, soft_wrap=True)
            self._console.print(Text(_LEGEND, style="dim"), soft_wrap=True)
            self._header_printed = True
        row = Text(str(step).rjust(_STEP_WIDTH), style="cyan")
        for _, width, get in _COLUMNS:
            text = _fmt(get(values), width)
            row.append(" " + text.rjust(width), style="dim" if text == "-" else "")
        self._console.print(row, soft_wrap=True)

    @contextlib.contextmanager
    def progress(self, total: int, description: str) -> Iterator[_Progress | _NoProgress]:
        """A progress bar for a counted phase (e.g. finished rollout groups); call `.advance(n)`."""
        if self._console is None:
            yield _NoProgress()
            return
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        # A bar only helps a live terminal; in a redirected log it would leave blank lines.
        live = self._console.is_terminal
        with Progress(*columns, console=self._console, transient=True, disable=not live) as bar:
            yield _Progress(bar, bar.add_task(description, total=total))

    def info(self, msg: str) -> None:
        self._message("INFO", msg, "")

    def warning(self, msg: str) -> None:
        self._message("WARNING", msg, "bold yellow")

    def _message(self, level: str, msg: str, style: str) -> None:
        if not self.enabled:
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self._append(LOG_FILE, f"{stamp} {level} {msg}\n")
        if self._console is not None:
            prefix = "warning: " if level == "WARNING" else ""
            self._console.print(Text(prefix + msg, style=style), soft_wrap=True)  # a line stays one line

    def _append(self, name: str, text: str) -> None:
        """Append and flush `text`; a failed write (a full disk) is an OSError naming the file, whose
        own message (e.g. "[Errno 28] No space left on device") does not."""
        path = self.output_dir / name
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(text)
                f.flush()
        except OSError as err:
            raise OSError(f"cannot write {path}: {err.strerror or err}") from err

    def close(self) -> None:
        """Finish the wandb run (uploads it when online); safe to call twice."""
        run, self._wandb_run = self._wandb_run, None
        if run is not None:
            try:
                run.finish()
            except Exception as err:  # noqa: BLE001
                self.warning(f"wandb finish failed ({type(err).__name__}: {err})")


def read_metrics(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of OUTPUT_DIR/metrics.jsonl in file order, one dict per `log` call.

    A resumed run appends after the old records, so a step can appear more than once; the later
    record is the newer one. A torn last line (the process killed mid-write) is skipped.
    """
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON object ({err})") from err
    return records


def _ranges(steps: list[int]) -> str:
    """'0-4, 7' for [0, 1, 2, 3, 4, 7] (sorted, distinct)."""
    spans: list[list[int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _steps_line(records: list[dict[str, Any]], seconds: float) -> str:
    """'10 steps in 12.3 s', or for a resumed run 'steps 5-9 of this run in 12.3 s (0-4 earlier)'.

    This run's records are those written in its last `seconds`, less a step's record that it
    restored from the checkpoint (that step ran before the resume)."""
    since = time.time() - seconds
    mine = sorted({r["step"] for r in records if r.get("time", 0) >= since and not r.get("resume/record_from_checkpoint")})
    earlier = sorted({r["step"] for r in records} - set(mine))
    if not earlier:
        return f"{len(mine)} steps in {seconds:.1f} s"
    ran = f"steps {_ranges(mine)}" if mine else "no steps"
    return f"{ran} of this run in {seconds:.1f} s ({_ranges(earlier)} earlier)"


def run_summary(output_dir: str | os.PathLike, seconds: float) -> str:
    """What a finished run did, in a few lines: the steps this run ran in its `seconds` so far (and
    those of the runs it resumed), the rollout reward's first fifth against its last fifth and each eval
    set's first and last score (over every step of the training), and where the outputs are."""
    records = read_metrics(output_dir)
    steps: dict[int, dict[str, Any]] = {}
    for record in records:
        steps.setdefault(record["step"], {}).update(record)
    rows = [steps[s] for s in sorted(steps)]
    lines = [_steps_line(records, seconds)]
    rewards = [r["rollout/raw_reward"] for r in rows if r.get("rollout/raw_reward") is not None]
    if rewards:
        fifth = max(1, len(rewards) // 5)
        first, last = sum(rewards[:fifth]) / fifth, sum(rewards[-fifth:]) / fifth
        lines.append(f"reward {first:.3f} (first fifth of the steps) -> {last:.3f} (last fifth)")
    for key in sorted({k for r in rows for k in r if k.startswith("eval/") and "/avg@" in k}):
        scores = [r[key] for r in rows if r.get(key) is not None]
        if scores:
            lines.append(f"{key} {scores[0]:.3f} -> {scores[-1]:.3f}")
    lines.append(f"outputs in {output_dir} ({METRICS_FILE}; `./launch.sh plot {output_dir}` draws them)")
    return "\n".join(lines)
