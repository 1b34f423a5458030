"""What each KV connector supports, checked by the planner before anything launches.

Pure. The table is read from vLLM 0.32's connectors: both MooncakeConnector and
NixlConnector map prefill TP ranks onto decode TP ranks (heterogeneous TP, "LBHNC" layout)
when one TP size divides the other, in both directions (``tp_size % remote_tp_size == 0``
or ``remote_tp_size % tp_size == 0`` is asserted in their TP mapping); both serve several
prefill and several decode instances behind one router.
"""

from __future__ import annotations

from pd_sessions.config import ClusterConfig
from pd_sessions.errors import PlanError

# connector -> (heterogeneous TP, several instances per role)
SUPPORT: dict[str, tuple[bool, bool]] = {
    "mooncake": (True, True),
    "nixl": (True, True),
}


def check(config: ClusterConfig) -> None:
    """Raise PlanError naming the connector and the pair when ``config`` asks for what its
    connector cannot do.

        connector unknown to the table                      -> PlanError
        prefill TP == decode TP                              -> ok
        TP differs, connector without heterogeneous TP       -> PlanError
        TP differs, neither size divides the other (TP2+TP3) -> PlanError (asserted by vLLM)
        several instances per role, connector without xPyD  -> PlanError
    """
    c = config
    if c.connector not in SUPPORT:
        raise PlanError("connector", f"no support entry for connector {c.connector!r}")
    hetero, many = SUPPORT[c.connector]
    pair = f"prefill TP{c.prefill_tp} + decode TP{c.decode_tp}"
    if c.prefill_tp != c.decode_tp:
        if not hetero:
            raise PlanError(
                "decode_tp",
                f"{c.name}: connector {c.connector} does not support "
                f"heterogeneous TP ({pair}); use equal TP sizes",
            )
        big, small = max(c.prefill_tp, c.decode_tp), min(c.prefill_tp, c.decode_tp)
        if big % small:
            raise PlanError(
                "decode_tp",
                f"{c.name}: connector {c.connector} cannot map {pair}: "
                "one TP size must divide the other (e.g. TP1 + TP2, TP2 + TP4)",
            )
    if (c.num_prefill > 1 or c.num_decode > 1) and not many:
        raise PlanError(
            "num_prefill" if c.num_prefill > 1 else "num_decode",
            f"{c.name}: connector {c.connector} does not support several instances per "
            f"role ({c.num_prefill}P{c.num_decode}D)",
        )
