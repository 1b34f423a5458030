"""``pd-sessions wheelhouse``: a passthrough; the wheelhouse parses its own options
(pd_sessions.env.wheelhouse, standard library and packaging only: ``nox -s wheelhouse`` runs it
in a venv holding only pip, uv and packaging)."""

from __future__ import annotations

import argparse

from pd_sessions.env import wheelhouse


def run(args: argparse.Namespace) -> int:
    return wheelhouse.main(args.rest)
