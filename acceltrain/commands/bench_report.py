"""``acceltrain bench``'s report: the rows as a Markdown table and a bar chart (a row that did not run is drawn as
such, never as a zero)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Row:
    name: str
    flags: list[str]
    processes: int = 1
    status: str = "ok"  # or "skipped: <reason>"
    figures: dict = field(default_factory=dict)
    reference: float | None = None  # samples/s of the same configuration on 1 process, for scaling rows
    kept: bool = True  # False: slower than the configuration it built on, left out of the next rows


def render(rows: list[Row], machine: str) -> str:
    """The Markdown table: speed-up against the first row that ran."""
    base = next((r.figures["samples_per_second"] for r in rows if r.figures.get("samples_per_second")), None)
    lines = [
        f"Machine: {machine}",
        "",
        "| configuration | processes | batch | samples/s | ms/step | speed-up | peak memory (MB) | MFU | note "
        "| flags |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for row in rows:
        if row.status != "ok":
            lines.append(f"| {row.name} | {row.processes} | | | | | | | {row.status} | `{' '.join(row.flags)}` |")
            continue
        f = row.figures
        speedup = f["samples_per_second"] / base if base else None
        notes = []
        if row.reference:
            notes.append(f"scaling efficiency {f['samples_per_second'] / (row.processes * row.reference):.0%}")
        if not row.kept:
            notes.append("slower than the row it builds on: not kept for the rows below")
        if f.get("compile_seconds"):
            notes.append(f"compile {f['compile_seconds']:.0f} s (excluded)")
        note = "; ".join(notes)
        mfu = "" if f["mfu"] is None else f"{f['mfu']:.1%}"
        lines.append(
            f"| {row.name} | {row.processes} | {f['batch_size']} | {f['samples_per_second']:.1f} | "
            f"{f['ms_per_step']:.1f} | {speedup:.2f}x | {f['peak_memory_mb']:.0f} | {mfu} | {note} | "
            f"`{' '.join(row.flags)}` |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: Path, title: str) -> str | None:
    """bench.png; None, or why not (matplotlib missing from a broken install)."""
    if importlib.util.find_spec("matplotlib") is None:
        return "bench.png not written: pip install matplotlib"
    if not any(r.status == "ok" for r in rows):
        return "bench.png not written: no row ran"
    bench_figure(rows, title).savefig(path, dpi=100)
    return None


NOT_KEPT_STYLE = {"facecolor": "lightgrey", "hatch": "//", "edgecolor": "grey"}


def bench_figure(rows: list[Row], title: str):
    """Speed-up against the first row that ran (a dashed 1.0x line) and peak memory, one bar per row
    labelled with its batch size, processes and value; rows not kept (slower than the row they build on)
    are grey, hatched and say so, skipped rows too."""
    from matplotlib.figure import Figure  # not pyplot: no global backend is changed, PNG through Agg

    base_row = next(r for r in rows if r.status == "ok")
    base = base_row.figures["samples_per_second"]
    labels = [
        r.name
        + (f", batch {r.figures['batch_size']}" if r.status == "ok" else "")
        + f", {r.processes} process{'es' if r.processes > 1 else ''}"
        + ("" if r.kept else " (not kept)")
        for r in rows
    ]
    styles = [{"facecolor": "tab:blue"} if r.kept else NOT_KEPT_STYLE for r in rows]
    figure = Figure(figsize=(13, 1.6 + 0.5 * len(rows)))
    speed, memory = figure.subplots(1, 2, sharey=True)
    for axis, values, text in (
        (speed, [r.figures["samples_per_second"] / base if r.status == "ok" else 0.0 for r in rows], "{:.2f}x"),
        (memory, [r.figures["peak_memory_mb"] if r.status == "ok" else 0.0 for r in rows], "{:.0f} MB"),
    ):
        for position, (row, value, style) in enumerate(zip(rows, values, styles, strict=True)):
            axis.barh(position, value, **style)
            axis.text(
                value, position, f" {text.format(value)}" if row.status == "ok" else " skipped", va="center", fontsize=9
            )
        axis.margins(x=0.15)
    speed.axvline(1.0, color="black", linestyle="--", linewidth=1)
    speed.set_xlabel(f"speed-up vs {base_row.name} ({base:.1f} samples/s = 1.0x)")
    memory.set_xlabel("peak memory (MB)")
    speed.set_yticks(range(len(rows)), labels)
    speed.invert_yaxis()  # the ladder reads top-down, as in bench.md
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def _loads(averages) -> str:
    return "/".join(f"{value:.2f}" for value in averages)
