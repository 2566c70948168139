"""`acceltrain bench`, --profile-steps and --memory-report on CPU with a tiny model and few steps."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import RECIPE, REPO, check, launch, read_summary, subprocess_env


@pytest.mark.slow
def test_bench_ladder_writes_consistent_json_markdown_and_chart(tmp_path):
    out = tmp_path / "bench"
    command = [
        sys.executable,
        "-m",
        "acceltrain.commands.cli",
        "bench",
        "--rows",
        "fp32,mixed-precision,channels-last",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--batch-size",
        "8",
        "--processes",
        "1,2",
        "--output-dir",
        str(out),
    ]
    result = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    rows = report["rows"]
    assert [(r["name"], r["processes"]) for r in rows] == [
        ("fp32", 1),
        ("mixed-precision", 1),
        ("channels-last", 1),
        (f"{rows[3]['name']}", 2),
    ]
    assert all(r["status"] == "ok" and r["figures"]["samples_per_second"] > 0 for r in rows)
    assert rows[3]["reference"] == max(r["figures"]["samples_per_second"] for r in rows[:3])
    rates = [r["figures"]["samples_per_second"] for r in rows[:2]]
    assert rows[1]["kept"] == (rates[1] >= rates[0]), "a row that made it slower is not kept"
    base = rows[1] if rows[1]["kept"] else rows[0]
    assert rows[2]["flags"] == base["flags"] + ["--channels-last"], "each row builds on the fastest so far"
    markdown = (out / "bench.md").read_text()
    first = rows[0]["figures"]["samples_per_second"]
    assert f"| fp32 | 1 | 8 | {first:.1f} |" in markdown and "1.00x" in markdown and "scaling efficiency" in markdown
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "AMD" in report["machine"] or "cores" in report["machine"]
    load = report["load_average"]
    assert len(load["before"]) == len(load["after"]) == 3 and load["cores"] >= 1 and "Load average" in markdown
    assert "warning: --steps 3 is too few for a stable figure" in result.stdout


def test_bench_png_shows_the_baseline_values_batches_and_rows_not_kept():
    from acceltrain.commands.bench_report import NOT_KEPT_STYLE, Row, bench_figure

    def ran(name, rate, kept=True):
        figures = {"samples_per_second": rate, "peak_memory_mb": 100.0, "batch_size": 8}
        return Row(name, [], figures=figures, kept=kept)

    rows = [
        ran("fp32", 100.0),
        ran("mixed-precision", 50.0, kept=False),
        ran("channels-last", 150.0),
        Row("compile", ["--compile"], status="skipped: no compiler"),
    ]
    figure = bench_figure(rows, title="acceltrain bench: resnet_tiny")
    speed, memory = figure.axes
    assert figure._suptitle.get_text() == "acceltrain bench: resnet_tiny"
    assert [tuple(line.get_xdata()) for line in speed.lines] == [(1.0, 1.0)], "a 1.0x line"
    assert [label.get_text() for label in speed.get_yticklabels()] == [
        "fp32, batch 8, 1 process",
        "mixed-precision, batch 8, 1 process (not kept)",
        "channels-last, batch 8, 1 process",
        "compile, 1 process",
    ]
    assert [text.get_text().strip() for text in speed.texts] == ["1.00x", "0.50x", "1.50x", "skipped"]
    hatches = [bar.get_hatch() for bar in speed.patches[:4]]
    assert hatches == [None, NOT_KEPT_STYLE["hatch"], None, None]


@pytest.mark.slow
def test_bench_reports_a_row_that_cannot_run_as_skipped_with_the_reason(tmp_path):
    out = tmp_path / "bench"
    command = [
        sys.executable,
        "-m",
        "acceltrain.commands.cli",
        "bench",
        "--rows",
        "fp32",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--batch-size",
        "100000",
        "--output-dir",
        str(out),
    ]
    result = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0
    (row,) = json.loads((out / "bench.json").read_text())["rows"]
    assert row["status"].startswith("skipped: error: --batch-size 100000 is too large")
    assert "skipped: error: --batch-size" in (out / "bench.md").read_text()


@pytest.mark.slow
def test_profile_steps_write_a_loadable_trace_and_top_operators(tmp_path):
    out = tmp_path / "run"
    check(
        launch(
            RECIPE,
            [
                "--dataset",
                "synthetic",
                "--model",
                "resnet_tiny",
                "--batch-size",
                "8",
                "--max-steps",
                "4",
                "--profile-steps",
                "2:3",
                "--memory-report",
                "--output-dir",
                str(out),
                "--no-progress",
                "--num-workers",
                "0",
            ],
        )
    )
    trace = json.loads((out / "profile" / "trace.json").read_text())
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    top = (out / "profile" / "top_ops.txt").read_text()
    assert "optimizer steps 2..3" in top and "by time" in top and "by memory" in top
    stages = [row["stage"] for row in json.loads((out / "memory.json").read_text())]
    assert stages == ["model on device", "first forward", "first backward", "first optimizer step"]
    assert read_summary(out)["steps"] == 4


def test_bad_profile_range_is_a_one_line_error(tmp_path):
    result = launch(RECIPE, ["--profile-steps", "5:2", "--output-dir", str(tmp_path / "x")])
    assert result.returncode == 2 and result.stderr.strip().startswith("error: --profile-steps '5:2' is invalid")
