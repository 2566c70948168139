"""The docs site and README: the site builds with ``mkdocs build --strict`` (every link, anchor and API
reference resolves), README stays a front door that links into it, and the docs' list of built-in hooks is
the order ``builtin_hooks`` really runs them in."""

from __future__ import annotations

import re
import subprocess
import sys
import time

from conftest import REPO, subprocess_env

README = REPO / "README.md"
DOCS = REPO / "docs"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), not images


def test_the_docs_site_builds_strictly_offline_in_seconds(tmp_path):
    """Run from another folder (mkdocs.yml's paths are its own), into tmp_path. --strict: a broken link or
    anchor, a page left out of the nav, or an API name griffe cannot find fails the build."""
    site = tmp_path / "site"
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site), "-f", str(REPO / "mkdocs.yml")],
        cwd=tmp_path,
        env=subprocess_env(NO_MKDOCS_2_WARNING="1"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    seconds = time.perf_counter() - started
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert seconds < 60, f"the docs build took {seconds:.1f} s"
    for page in (
        "index.html",
        "bad-input/index.html",
        "hooks/index.html",
        "changelog/index.html",
        "api/training/index.html",
    ):
        assert (site / page).is_file(), page
    assert (site / "curves.png").is_file() and (site / "time_to_accuracy.png").is_file()
    api = (site / "api" / "training" / "index.html").read_text()
    assert "Train model on train_set" in re.sub(r"<[^>]+>", "", api)  # fit's docstring, read from the source
    assert ":class:" not in (site / "api" / "hooks" / "index.html").read_text()  # rST roles shown as code
    assert "Keep a Changelog" in (site / "changelog" / "index.html").read_text()  # ../CHANGELOG.md included
    # nothing is fetched to build or to read the pages: no web fonts (theme.font: false), no CDN
    for html in site.rglob("*.html"):
        assert "fonts.googleapis.com" not in html.read_text(), html


def test_the_readme_is_a_front_door_of_at_most_250_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move the details to a page in docs/"
    assert "mkdocs serve" in README.read_text()


def _slug(heading: str) -> str:
    """The anchor of a heading, as Python-Markdown's toc and GitHub both make it for these headings."""
    heading = re.sub(r"[`*]", "", heading.strip()).lower()
    return re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", heading))


def _anchors(page) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '# comment' in a code block is no heading
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_every_relative_link_in_the_readme_exists():
    """README's links into docs/ (and to CHANGELOG.md) are relative, so they work on GitHub; each target
    exists and each #anchor is a heading of its page."""
    targets = [t for t in LINK.findall(README.read_text()) if not re.match(r"[a-z]+:", t)]
    assert sum(t.startswith("docs/") for t in targets) >= 10, targets
    for target in targets:
        path, _, anchor = target.partition("#")
        page = REPO / path
        assert page.is_file(), f"README links to {target}: no such file"
        if anchor:
            assert anchor in _anchors(page), f"README links to {target}: {path} has no heading with that anchor"
    for page in sorted(DOCS.glob("*.md")):  # every page is linked from README (the API pages are the site's)
        if page.name not in ("index.md", "changelog.md"):
            assert f"docs/{page.name}" in targets, f"README's 'Where to read on' does not link {page.name}"


def test_the_readme_examples_and_commands_are_on_the_docs_pages_too():
    """README keeps the examples and commands; the site must show the same ones (a copy kept in step)."""
    docs = "\n".join(p.read_text() for p in sorted(DOCS.rglob("*.md")))
    for block in re.findall(r"```\w*\n(.*?)```", README.read_text(), re.S):
        for line in block.splitlines():
            if line.strip():
                assert line in docs, f"README's line is on no docs page: {line}"
    readme = README.read_text()
    intro = readme.split("\n## ")[0].split("\n", 1)[1].strip()
    quick_start = readme.split("## Quick start\n")[1].split("\n## ")[0].strip()
    index = (DOCS / "index.md").read_text()
    assert intro in index and quick_start in index, (
        "docs/index.md shows README's introduction and Quick start as they are"
    )


def test_the_docs_list_the_builtin_hooks_in_running_order():
    """docs/hooks.md's table of built-in hooks against what builtin_hooks returns with every option on."""
    from acceltrain.config.train_config import TrainConfig
    from acceltrain.hooks import builtin_hooks

    cfg = TrainConfig(
        profile_steps="1:2",
        memory_report=True,
        target_metric=0.9,
        early_stopping_patience=2,
        time_budget_minutes=5.0,
        save_every_steps=10,
        plots=True,
        push_to_hub=True,
    )
    cfg.validate()
    running = [type(hook).__name__ for hook in builtin_hooks(cfg, evaluates=True, trackers=["wandb"], run_config={})]
    text = (DOCS / "hooks.md").read_text()
    table = text.split("<!-- the built-in hooks in running order")[1].split("\n\n")[0]
    rows = [line for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
    documented = [re.search(r"`(\w+)`", row.split("|")[2]).group(1) for row in rows]
    assert documented == running
    assert [int(row.split("|")[1]) for row in rows] == list(range(1, len(rows) + 1))


def test_the_docs_name_exactly_the_public_attributes_of_run():
    """docs/hooks.md's "The run" section against ``RUN_PUBLIC`` (which tests/test_state_model.py checks against
    a real Run): every public name is documented, and no other name is listed as one."""
    from acceltrain.train.run import RUN_PUBLIC

    section = (DOCS / "hooks.md").read_text().split("## The run\n")[1].split("```python")[0]
    bullets = " ".join(line for line in section.splitlines() if line.startswith(("- **", "  ")))
    named = set(re.findall(r"`(\w+)`", bullets))
    assert set(RUN_PUBLIC) <= named, f"not documented: {sorted(set(RUN_PUBLIC) - named)}"
    assert named - set(RUN_PUBLIC) <= {"RunState"}, f"documented but not public: {sorted(named - set(RUN_PUBLIC))}"
