"""The CLI (or any argv, such as nox) in a subprocess, its output timestamped as it arrives."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from helpers import ROOT
from helpers.waiting import wait_until


def nox_no_venv(python: str | Path, *posargs: str, session: str = "mooncake_sweep") -> list[str]:
    """argv of `nox --no-venv -s SESSION -- --platform cpu POSARGS` run by ``python`` (default
    mooncake_sweep): the installed-environment mode on that interpreter."""
    return [
        str(python),
        "-m",
        "nox",
        "-f",
        str(ROOT / "noxfile.py"),
        "--no-venv",
        "-s",
        session,
        "--",
        "--platform",
        "cpu",
        *posargs,
    ]


def plan_ports(run_dir: Path) -> dict[str, int]:
    """name -> HTTP port, read from the plan the harness wrote before launching."""
    text = (run_dir / "plan.txt").read_text()
    return {
        m.group(1): int(m.group(2)) for m in re.finditer(r"^  (\S+): http://127\.0\.0\.1:(\d+)", text, re.M)
    }


class Cli:
    """The CLI (or ``argv``) in a subprocess, with each output line timestamped as it arrives
    (``time.time()``: comparable with the times the fake servers print)."""

    def __init__(
        self,
        *args: str,
        argv: list[str] | None = None,
        cwd: Path = ROOT,
        env: dict[str, str] | None = None,
        new_session: bool = False,
    ):
        """``new_session``: the process leads a group of its own (signalled as one)."""
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            argv or [sys.executable, "-m", "pd_sessions", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=new_session,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))
            print(line, end="", flush=True)  # shown by pytest -s, or when a test fails

    def wait(self, timeout: float = 120) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(10)
        return rc

    def first(self, needle: str) -> float:
        """When the first line with ``needle`` arrived."""
        return next(t for t, line in self.lines if needle in line)

    def wait_for(self, needle: str, timeout: float = 60) -> None:
        """Until a line with ``needle`` arrives; fails at ``timeout`` or when the process exits first."""
        wait_until(
            lambda: any(needle in line for _, line in self.lines),
            timeout,
            lambda: f"{needle!r} in the output:\n{self.text}",
            proc=self.proc,
        )

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def environment_facts(tmp_path: Path) -> dict:
    out = tmp_path / "facts.json"
    subprocess.run(
        [sys.executable, "-m", "pd_sessions.env.envfacts", "--out", str(out)], check=True, cwd=ROOT
    )
    return json.loads(out.read_text())
