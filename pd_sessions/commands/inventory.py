"""``pd-sessions inventory``: print the detected host inventory as JSON."""

from __future__ import annotations

import argparse
import json

from pd_sessions.core.inventory import resolve_platform
from pd_sessions.runtime import machine


def run(args: argparse.Namespace) -> int:
    inv = machine.detect()
    doc = {
        "gpus": list(inv.gpus),
        "cpus": list(inv.cpus),
        "gpu_source": inv.gpu_source,
        "platform": resolve_platform(None, inv),
    }
    print(json.dumps(doc))
    return 0
