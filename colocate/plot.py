"""Curves of a run's metrics vs step, one PNG per metric group, from OUTPUT_DIR/metrics.jsonl.

    python -m colocate.plot OUTPUT_DIR [--out DIR] [--keys 'rollout/raw_reward,perf/*']

A group is a key's first path component (rollout, train, eval, perf, memory, ...). Within a group
each metric gets its own panel, except the per-phase families, which share one so that phases
compare at a glance: `perf/*_time` in one "seconds" panel, `memory/<phase>/<kind>` in one panel per
kind with a line per phase. The start-up parts (`perf/startup/*`, logged once, with a run's first
step) are one bar chart in perf.png. Metrics that never change are left out unless --keys names
them. Works on a run that is still going (the file is append-only).
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import sys
from pathlib import Path
from typing import Any

from colocate.cli import DEBUG_HELP, entry_point
from colocate.metrics import METRICS_FILE, read_metrics, split_startup, startup_phases

_NUM_PANEL_COLUMNS = 3
_STARTUP_PREFIX = "perf/startup/"
_STARTUP_PANEL = "start-up"


def merge_by_step(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """One dict per step; later records win, so a resumed run's re-logged steps replace the old ones
    and separate `log` calls for one step (train, then eval) combine."""
    steps: dict[int, dict[str, Any]] = {}
    for record in records:
        steps.setdefault(record["step"], {}).update(record)
    return dict(sorted(steps.items()))


def _panel_and_label(key: str) -> tuple[str, str]:
    """Which panel of its group's figure a metric is drawn in, and its line's legend label."""
    parts = key.split("/")
    if parts[0] == "memory" and len(parts) >= 3:
        return f"memory/{parts[-1]}", "/".join(parts[1:-1])
    if parts[0] == "perf" and key.endswith("_time"):
        return "perf/*_time (s)", key.removeprefix("perf/").removesuffix("_time")
    return key, key


def collect_series(
    steps: dict[int, dict[str, Any]], patterns: list[str] | None = None
) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """{group: {key: (steps, values)}} for every metric with at least one finite value.

    `patterns` are fnmatch globs on the full key (an exact key is its own glob); None keeps every
    metric whose value changes at some step (a flat line says nothing a legend could not).
    """
    series: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    keys = sorted({k for m in steps.values() for k in m if k not in ("step", "time")})
    for key in keys:
        if key.startswith(_STARTUP_PREFIX):  # one value per run: `latest_startup` draws them
            continue
        if patterns is not None and not any(fnmatch.fnmatchcase(key, p) for p in patterns):
            continue
        xs = [step for step, m in steps.items() if key in m]
        # null is how the file stores NaN/inf; NaN breaks the line there instead of bridging it.
        ys = [math.nan if steps[step][key] is None else float(steps[step][key]) for step in xs]
        finite = [y for y in ys if math.isfinite(y)]
        if not finite or (patterns is None and len(finite) > 1 and len(set(finite)) == 1):
            continue
        group = key.split("/")[0] if "/" in key else "misc"
        series.setdefault(group, {})[key] = (xs, ys)
    return series


def latest_startup(steps: dict[int, dict[str, Any]], patterns: list[str] | None = None) -> tuple[int, dict[str, float]] | None:
    """(step, {part: seconds}) of the last step that logged start-up parts (a resumed run logs its
    own with its first step), or None; `patterns` as in `collect_series`."""
    for step in reversed(steps):
        record = {
            k: v
            for k, v in steps[step].items()
            if k.startswith(_STARTUP_PREFIX)
            and isinstance(v, (int, float))
            and math.isfinite(v)
            and (patterns is None or any(fnmatch.fnmatchcase(k, p) for p in patterns))
        }
        if record:
            return step, startup_phases(record)
    return None


def _check_steps(path: Path, records: list[Any]) -> None:
    """Every record is an object with an integer step; the first that is not is named by its line
    (read_metrics skips blank lines, so the records are the file's other lines in order)."""
    for index, record in enumerate(records):
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            lines = path.read_text(encoding="utf-8").splitlines()
            number = [n for n, line in enumerate(lines, start=1) if line.strip()][index]
            raise ValueError(f"{path}:{number}: a metrics record needs an integer \"step\"")


def _draw_startup(ax: Any, step: int, parts: dict[str, float]) -> None:
    """One bar per start-up part, in the order the run went through them, each followed by its
    sub-parts in a lighter bar (`engine`, then `cuda graphs`), seconds written at the bar's end."""
    top, subs = split_startup(parts)
    bars: list[tuple[str, float, float]] = []  # (label, seconds, alpha)
    for part, seconds in top.items():
        bars.append((part.replace("_", " "), seconds, 1.0))
        bars += [(sub.replace("_", " "), s, 0.45) for sub, s in subs.get(part, {}).items()]
    ys = range(len(bars))
    for y, (_, seconds, alpha) in zip(ys, bars):
        ax.barh(y, seconds, color="C0", alpha=alpha)
        ax.text(seconds, y, f" {seconds:.1f}", va="center", fontsize=7)
    ax.set_yticks(list(ys), [label for label, _, _ in bars], fontsize=7)
    ax.invert_yaxis()  # the first part on top
    ax.margins(x=0.15)
    ax.set_title(f"{_STARTUP_PANEL} {sum(top.values()):.1f} s (step {step})", fontsize=9)
    ax.set_xlabel("seconds", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(axis="x", alpha=0.3)


def plot(output_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None, keys: list[str] | None = None) -> list[Path]:
    """Write one PNG per metric group into `out_dir` (default OUTPUT_DIR/plots); return their paths."""
    records = read_metrics(output_dir)
    if not records:
        raise ValueError(f"{Path(output_dir) / METRICS_FILE} has no records yet")
    _check_steps(Path(output_dir) / METRICS_FILE, records)
    steps = merge_by_step(records)
    series = collect_series(steps, keys)
    startup = latest_startup(steps, keys)
    if startup is not None:
        series.setdefault("perf", {})
    if not series:
        wanted = f" matching --keys {','.join(keys)}" if keys else ""
        raise ValueError(f"{Path(output_dir) / METRICS_FILE} has no metric with a finite value{wanted}")
    out = Path(out_dir) if out_dir is not None else Path(output_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for group, group_series in sorted(series.items()):
        panels: dict[str, list[tuple[str, list[int], list[float]]]] = {}
        if group == "perf" and startup is not None:
            panels[_STARTUP_PANEL] = []  # drawn by _draw_startup
        for key, (xs, ys) in group_series.items():
            panel, label = _panel_and_label(key)
            panels.setdefault(panel, []).append((label, xs, ys))
        num_cols = min(_NUM_PANEL_COLUMNS, len(panels))
        num_rows = math.ceil(len(panels) / num_cols)
        figsize = (4.5 * num_cols, 3.2 * num_rows)
        fig, axes = plt.subplots(num_rows, num_cols, figsize=figsize, squeeze=False)
        for ax, (panel, lines) in zip(axes.flat, panels.items()):
            if panel == _STARTUP_PANEL:
                _draw_startup(ax, *startup)
                continue
            for label, xs, ys in lines:
                # Markers keep sparse series (eval every N steps, a one-step run) visible.
                ax.plot(xs, ys, marker="." if len(xs) <= 50 else None, label=label)
            ax.set_title(panel, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if len(lines) > 1:
                ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        fig.suptitle(f"{group}  ({Path(output_dir).name})", fontsize=11)
        fig.tight_layout()
        path = out / f"{group}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


@entry_point
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m colocate.plot", description=__doc__.splitlines()[0], epilog=DEBUG_HELP)
    parser.add_argument("output_dir", help="a run's output directory (holds metrics.jsonl)")
    parser.add_argument("--out", default=None, help="where to write the PNGs (default OUTPUT_DIR/plots)")
    parser.add_argument("--keys", default=None, help="comma-separated names or globs, e.g. 'train/*,eval/*'")
    args = parser.parse_args(argv)
    keys = [k.strip() for k in args.keys.split(",") if k.strip()] if args.keys else None
    for path in plot(args.output_dir, args.out, keys):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
