"""The KV digest's side files: what the vLLM-side observer writes, the check reads. Pure.

The observer (pd_sessions/vllm_side/kv_observer.py, inside the fault-injecting connector's
subclass) writes one JSON object per line to its instance's side file
(``<run dir>/<instance>.kv_digest.jsonl``, :func:`side_file`), every worker rank of the instance
appending to it:

- ``"kind": "send"`` (prefill worker): a request's blocks the prefill holds for a decode to take;
  ``sums`` has, per layer, a checksum of each (``full`` of them are full: ``num_tokens //
  block_size``; a partial last block's tail is whatever an earlier request left there, and the
  connectors move it as it is);
- ``"kind": "load"`` (decode worker): the blocks a finished load filled, after any injected fault
  (what the decode will compute on); ``sums`` per layer, one per block it loaded;
- ``"kind": "unavailable"``: the observer cannot digest here, and ``reason`` says why;
  ``inapplicable`` (true) when the digest does not cover the layout (a hybrid model, a connector
  whose sends cannot be paired): the check is then NOT RUN without failing its config.

Both carry ``key`` (what the two sides know the transfer by: the connector's
:class:`~pd_sessions.core.connectors.base.SendLayout`), ``req`` (the instance's own request id),
``rank``/``world`` (tensor parallel), ``method`` (how a block's bytes were summed) and ``layout``
(each distinct dtype and block shape of the layers), and ``digest_s``: the seconds the
observer spent on the record's checksums (its cost, summed by the check as ``observer_s``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pd_sessions.core import connectors

# the key of the injector's settings (core/faults.py EXTRA_CONFIG_KEY) holding the side file's path
SETTING = "digest"
SUFFIX = ".kv_digest.jsonl"
KINDS = ("send", "load", "unavailable")


def not_covered(connector: str, *, decode_kv_transfer: bool) -> str | None:
    """Why the digest has nothing to compare in a config over ``connector`` (known before launch:
    its instances then run no observer and the check is NOT RUN, inapplicable), or None."""
    if not decode_kv_transfer:
        return "the decode loads no KV (decode_kv_transfer = false): there is no transfer to compare"
    if connectors.get(connector).send_layout is None:
        return (
            f"{connector}: the digest cannot pair its sends with its loads (no send_layout in its "
            "ConnectorSpec, pd_sessions/core/connectors/)"
        )
    return None


def side_file(run_dir: str | Path, instance: str) -> str:
    """The side file of ``instance`` in a config's run directory."""
    return str(Path(run_dir) / f"{instance}{SUFFIX}")


def line(**fields: Any) -> str:
    """One record, as written (keys sorted, one line)."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":")) + "\n"


def parse(text: str) -> list[dict[str, Any]]:
    """The records of a side file's text, in order; a line that does not parse (cut by a crash)
    or of an unknown kind is left out."""
    out = []
    for raw in text.splitlines():
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("kind") in KINDS:
            out.append(rec)
    return out
