"""``pd-sessions tiny-model``: generate (once) the tiny model and print its path."""

from __future__ import annotations

import argparse

from pd_sessions.runtime import tiny_model


def run(args: argparse.Namespace) -> int:
    print(tiny_model.ensure(cache_dir=args.cache_dir))
    return 0
