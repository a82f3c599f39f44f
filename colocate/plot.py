"""Curves of a run's metrics vs step, one PNG per metric group, from OUTPUT_DIR/metrics.jsonl.

    python -m colocate.plot OUTPUT_DIR [--out DIR] [--keys 'rollout/raw_reward,perf/*']

A group is a key's first path component (rollout, train, eval, perf, memory, ...). Within a group
each metric gets its own panel, except the per-phase families, which share one so that phases
compare at a glance: `perf/*_time` in one "seconds" panel, `memory/<phase>/<kind>` in one panel per
kind with a line per phase. Metrics that never change are left out unless --keys names them.
Works on a run that is still going (the file is append-only).
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
from colocate.metrics import METRICS_FILE, read_metrics

_NUM_PANEL_COLUMNS = 3


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


def plot(
    output_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None, keys: list[str] | None = None
) -> list[Path]:
    """Write one PNG per metric group into `out_dir` (default OUTPUT_DIR/plots); return their paths."""
    records = read_metrics(output_dir)
    if not records:
        raise ValueError(f"{Path(output_dir) / METRICS_FILE} has no records yet")
    series = collect_series(merge_by_step(records), keys)
    if not series:
        wanted = f" matching --keys {','.join(keys)}" if keys else ""
        raise ValueError(f"{Path(output_dir) / METRICS_FILE} has no metric with a finite value{wanted}")
    out = Path(out_dir) if out_dir is not None else Path(output_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for group, group_series in series.items():
        panels: dict[str, list[tuple[str, list[int], list[float]]]] = {}
        for key, (xs, ys) in group_series.items():
            panel, label = _panel_and_label(key)
            panels.setdefault(panel, []).append((label, xs, ys))
        num_cols = min(_NUM_PANEL_COLUMNS, len(panels))
        num_rows = math.ceil(len(panels) / num_cols)
        figsize = (4.5 * num_cols, 3.2 * num_rows)
        fig, axes = plt.subplots(num_rows, num_cols, figsize=figsize, squeeze=False)
        for ax, (panel, lines) in zip(axes.flat, panels.items()):
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
        for ax in list(axes.flat)[len(panels):]:
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
    parser = argparse.ArgumentParser(prog="python -m colocate.plot", description=__doc__.splitlines()[0],
                                     epilog=DEBUG_HELP)
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
