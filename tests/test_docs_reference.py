"""The docs site's reference pages are generated from the code (tools/docs_reference.py) and
committed: these tests fail when a page is stale, when a CLI option, config field, check, known
issue or nox session lacks its entry, and when the generator would write an empty entry. The
README stays one screen with its two commands, and every link in it and in the docs that points
into the repository resolves (the strict `mkdocs build` of `nox -s lint` checks the site's own
links and anchors; this checks the files GitHub renders outside it)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import docs_reference as ref  # noqa: E402

from pd_sessions.core import check_registry, config, known_issues  # noqa: E402

REFERENCE = ROOT / "docs" / "reference"
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return ref.render()


def committed(name: str) -> str:
    return (REFERENCE / name).read_text()


def ids(text: str) -> set[str]:
    """The anchors a page defines: <a id="..."> (an anchor both mkdocs and GitHub keep)."""
    return set(re.findall(r'<a id="([^"]+)"></a>', text))


def test_the_committed_reference_pages_are_what_the_code_generates(pages):
    stale = ref.stale(pages)
    assert not stale, (
        f"stale in docs/reference/: {stale}; run `nox -s docs` (or python tools/docs_reference.py)"
    )


def test_the_pages_name_no_path_of_the_machine_they_were_generated_on(pages):
    """A default inside the repository is shown relative to it (the pages were generated in a
    worktree once, and every other checkout then read them as stale)."""
    assert ref.code(ROOT / "pd_sessions" / "x.toml") == "`PosixPath('pd_sessions/x.toml')`"
    assert not [name for name, text in pages.items() if str(ROOT) in text]


def test_stale_names_a_changed_page_a_missing_one_and_one_no_generator_writes(tmp_path):
    pages = {"a.md": "A\n", "b.md": "B\n", "c.md": "C\n"}
    (tmp_path / "a.md").write_text("A\n")
    (tmp_path / "b.md").write_text("B, edited by hand\n")
    (tmp_path / "old.md").write_text("a page no generator writes\n")
    assert ref.stale(pages, tmp_path) == ["b.md", "c.md", "old.md"]


def test_every_cli_option_has_its_entry_on_the_cli_page():
    page = committed("cli.md")
    have = ids(page)
    for command, parser in ref.cli_parsers():
        for key, flags, _, help_text in ref.option_entries(command, parser):
            assert key in have, f"`{command}` {flags}: no entry in docs/reference/cli.md; run `nox -s docs`"
            assert help_text.strip(), f"`{command}` {flags}: no help"
        name = command.split()[-1]
        if command != "pd-sessions":
            assert ref.anchor(name) in have, command


def test_an_option_without_help_is_an_error_naming_it():
    p = argparse.ArgumentParser(prog="pd-sessions")
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("sweep", help="run a sweep")
    s.add_argument("--documented", help="says what it does")
    s.add_argument("--silent", type=int)
    with pytest.raises(ref.UndocumentedError) as e:
        ref.page_cli([("pd-sessions", p), ("pd-sessions sweep", s)])
    assert e.value.missing == [
        "`pd-sessions sweep` --silent SILENT: no help; give its add_argument a help=..."
    ]


def test_every_config_field_and_sweep_key_has_its_entry():
    page = committed("sweep-toml.md")
    have = ids(page)
    comments = ref.field_comments(config.ClusterConfig)
    for f in dataclasses.fields(config.ClusterConfig):
        assert ref.anchor(f.name) in have, f"config field {f.name}: no entry in docs/reference/sweep-toml.md"
        assert comments.get(f.name), f"config field {f.name}: no comment above it in core/config.py"
    for key in config.SWEEP_KEYS:
        assert f"key-{ref.anchor(key)}" in have, f"sweep key {key}: no entry"


@dataclasses.dataclass(frozen=True)
class _Fields:
    # How many prefill and decode instances.
    num_prefill: int = 1
    num_decode: int = 1
    spread: tuple[str, ...] = dataclasses.field(
        default=(),
    )  # an inline comment on a field written over two lines
    silent: bool = False

    # After a blank line, a field does not share the comment above it.
    other: int = 0


def test_field_comments_read_a_shared_comment_an_inline_one_and_find_a_field_without():
    comments = ref.field_comments(_Fields)
    assert comments["num_prefill"] == comments["num_decode"] == "How many prefill and decode instances."
    assert comments["spread"] == "an inline comment on a field written over two lines"
    assert comments["silent"] == ""
    assert comments["other"].startswith("After a blank line")
    rows, missing = ref.field_rows(_Fields, "_Fields")
    assert [r[0] for r in rows] == ["num_prefill", "num_decode", "spread", "silent", "other"]
    assert missing == ["_Fields.silent: no comment; write one above the field in its class"]


def test_every_check_has_its_entry_and_one_without_a_summary_is_an_error():
    have = ids(committed("checks.md"))
    for name in check_registry.NAMES:
        assert ref.anchor(name) in have, f"check {name}: no entry in docs/reference/checks.md"
    bad = dataclasses.replace(check_registry.CHECKS[0], name="mute", summary=" ")
    with pytest.raises(ref.UndocumentedError, match="check 'mute': no summary"):
        ref.page_checks([check_registry.CHECKS[0], bad])


def test_a_check_or_option_added_without_regenerating_fails_naming_the_page(tmp_path, pages):
    """The drift the tests above catch, shown on the real pages: a check registered and a sweep
    option added after the pages were written make those two pages stale, and their new
    entries are missing from the committed text."""
    for name, text in pages.items():
        (tmp_path / name).write_text(text)
    added = dataclasses.replace(check_registry.CHECKS[0], name="new_check", summary="a new check")
    checks_page = ref.page_checks([*check_registry.CHECKS, added])
    parsers = ref.cli_parsers()
    sweep = dict(parsers)["pd-sessions sweep"]
    sweep.add_argument("--new-option", help="an option added later")
    cli_page = ref.page_cli(parsers)
    assert ref.stale({**pages, "checks.md": checks_page, "cli.md": cli_page}, tmp_path) == [
        "checks.md",
        "cli.md",
    ]
    assert ref.anchor("new_check") in ids(checks_page) - ids(pages["checks.md"])
    assert "sweep-new-option" in ids(cli_page) - ids(pages["cli.md"])


def test_every_known_issue_and_nox_session_has_its_entry():
    have = ids(committed("known-issues.md"))
    for issue in known_issues.load():
        assert ref.anchor(issue.id) in have, issue.id
    sessions = ref.nox_sessions()
    names = {n for n, _, _ in sessions}
    assert {"unit", "lint", "docs", "tests", "mooncake_sweep", "nixl_sweep"} <= names
    have = ids(committed("nox-sessions.md"))
    assert {ref.anchor(n) for n in names} <= have
    with pytest.raises(ref.UndocumentedError, match="nox session 'quiet': no docstring"):
        ref.page_nox([*sessions, ("quiet", "", [])])


def test_every_bug_class_has_its_entry_on_the_bug_catalogue_page(pages):
    from pd_sessions.core import bug_catalogue

    cat = bug_catalogue.load()
    assert len(cat.bugs) >= 15
    assert {ref.anchor(b.id) for b in cat.bugs} <= ids(committed("bug-catalogue.md"))
    assert all(f"`{b.injection.check}`" in pages["bug-catalogue.md"] for b in cat.bugs if b.injection.check)


def test_the_nav_lists_every_generated_reference_page():
    nav = (ROOT / "mkdocs.yml").read_text()
    for name in [*ref.PAGES, "index.md"]:
        assert f"reference/{name}" in nav, f"mkdocs.yml's nav lacks reference/{name}"


def _readme_command_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Two commands on a fresh machine", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_the_readme_is_one_screen_with_its_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    assert _readme_command_block() == [
        "python3 -m pip install nox uv && nox -s mooncake_sweep",
        "python3 -m pip install nox uv && nox -s tests",
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "nox -s tests" in ci and "the test command README.md gives" in ci


def test_the_readme_reaches_every_option_in_two_clicks():
    """README -> the CLI page (one click) -> the command's section, every option's row there
    (the second); README -> the sweep fields page, every field's row."""
    readme = (ROOT / "README.md").read_text()
    targets = set(LINK.findall(readme))
    assert "docs/reference/cli.md" in targets and "docs/reference/sweep-toml.md" in targets
    cli = committed("cli.md")
    sections = set(re.findall(r"\]\(#([^)]+)\)", cli))
    for command, _ in ref.cli_parsers()[1:]:
        assert ref.anchor(command.split()[-1]) in sections, command


def _markdown_files() -> list[Path]:
    return [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "CHANGELOG.md",
        *sorted((ROOT / "docs").rglob("*.md")),
    ]


def test_every_link_into_the_repository_resolves():
    """The files GitHub renders: README, CONTRIBUTING, CHANGELOG and docs/ (mkdocs checks the
    site's own links and anchors in strict mode; this also covers the three outside docs/)."""
    broken = []
    for md in _markdown_files():
        for target in LINK.findall(md.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (md.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, broken


def external_links() -> dict[str, list[str]]:
    """Every external link of the docs, README, CONTRIBUTING and CHANGELOG -> the files citing it
    (the strict build checks only internal ones; `pytest -s` on the next test prints these)."""
    out: dict[str, list[str]] = {}
    pattern = re.compile(r"(?:\]\(|<)(https?://[^)>\s]+)")
    for md in _markdown_files():
        for url in pattern.findall(md.read_text()):
            out.setdefault(url, []).append(str(md.relative_to(ROOT)))
    return out


def test_external_links_are_listed_and_well_formed():
    links = external_links()
    for url, files in sorted(links.items()):
        print(url, "<-", ", ".join(sorted(set(files))))
    assert all(re.fullmatch(r"https://[\w.-]+\.[a-z]{2,}(/\S*)?", u) for u in links), [
        u for u in links if not u.startswith("https://")
    ]
