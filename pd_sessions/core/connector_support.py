"""What each KV connector supports, checked by the planner before anything launches.

Pure. The table is read from vLLM 0.32's connectors: both MooncakeConnector and
NixlConnector map prefill TP ranks onto decode TP ranks (heterogeneous TP, "LBHNC" layout)
when one TP size divides the other, in both directions (``tp_size % remote_tp_size == 0``
or ``remote_tp_size % tp_size == 0`` is asserted in their TP mapping); both serve several
prefill and several decode instances behind one router.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from packaging.version import InvalidVersion, Version

from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.errors import PlanError

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


# Models with linear-attention (SSM) layers beside MLA layers, like Kimi-Linear. A local model
# directory is recognised by its config.json (see :func:`is_hybrid_mla`).
HYBRID_MLA_MODELS = frozenset({"moonshotai/Kimi-Linear-48B-A3B-Instruct", "tiny-kimi-linear"})

# vLLM < 0.27.0 cannot feed a lower-TP decode rank from a higher-TP prefill for such a model
# over NIXL: the pull worker asserts one source rank for MLA (``assert len(read_specs) == 1`` in
# nixl/pull_worker.py ``_read_blocks_for_req``), while the SSM state needs one read per prefill
# rank. Seen on the lent H200 x2 with vLLM 0.26.0 (docs/gpu-verification.md): the first
# transfer killed the decode's worker (EngineDeadError, HTTP 500). Fixed upstream by
# vllm-project/vllm#49297 (the assert skips hybrid models); 0.27.0's wheel has the fix.
HYBRID_MLA_HETERO_TP_FIXED_IN = Version("0.27.0")


def is_hybrid_mla(config: ClusterConfig, model_config: Mapping[str, Any] | None = None) -> bool:
    """A hybrid model whose full-attention layers are MLA: a known name, or a config.json
    (``model_config``) with both ``linear_attn_config`` and an MLA ``kv_lora_rank``."""
    if config.model in HYBRID_MLA_MODELS:
        return True
    mc = model_config or {}
    return bool(config.hybrid and mc.get("linear_attn_config") and mc.get("kv_lora_rank"))


def vllm_problem(config: ClusterConfig, vllm_version: str | None, *, hybrid_mla: bool) -> str | None:
    """Why this vLLM cannot serve ``config``'s pair, or None. Checked before launch, where the
    installed vLLM is known.

        connector not nixl, or not hybrid MLA               -> None
        prefill TP <= decode TP (per decode rank)           -> None
        vLLM version unknown or not a version               -> None (vLLM itself will say)
        vLLM >= 0.27.0                                      -> None (fixed upstream)
        otherwise                                           -> the pair, the version, the upstream
                                                               assert and fix, and what to change
    """
    c = config
    if c.connector != "nixl" or not hybrid_mla or c.prefill_tp <= c.decode_tp or not vllm_version:
        return None
    try:
        if Version(vllm_version) >= HYBRID_MLA_HETERO_TP_FIXED_IN:
            return None
    except InvalidVersion:
        return None
    return (
        f"{c.name}: vLLM {vllm_version} cannot pull KV over NIXL from prefill TP{c.prefill_tp} into "
        f"decode TP{c.decode_tp} ranks for {c.model} (SSM + MLA layers): its pull worker asserts a "
        "single source rank for MLA (`assert len(read_specs) == 1`, nixl/pull_worker.py) and the "
        "first transfer kills the decode's engine. Fixed in vLLM "
        f">= {HYBRID_MLA_HETERO_TP_FIXED_IN} (vllm-project/vllm#49297); with this vLLM use "
        f"--set prefill_tp={c.decode_tp}"
    )


# Request shapes a connector's P/D path does not serve in the vLLM we run (0.32), as seen, with the
# reason: the request_features check does not send them over that connector and names the reason
# in its verdict and results (a known limit, recorded; never a silent skip). Keyed by connector
# (issue 24 moves connector knowledge into one module per connector).
UNSERVED_REQUESTS: dict[str, dict[str, str]] = {
    "mooncake": {
        "n>1": (
            "n > 1 over MooncakeConnector: the decode's child requests wait for their KV (Mooncake "
            "keys a transfer by the one transfer_id the router gives the request, which both "
            "children carry); seen on the CPU lane with vLLM 0.32.0, 2026-12-01: a 2-choice "
            "seeded request waited 9.5 s once and over 40 s the next time (decode-0 reporting "
            "1 deferred request), NIXL served the same requests at once. Not sent, so that a stuck "
            "pull (vLLM's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT is 480 s) cannot hold up the checks"
        ),
    },
}


def unserved_request(connector: str, shape: str) -> str | None:
    """Why ``connector`` cannot serve requests of ``shape`` (e.g. "n>1"), or None."""
    return UNSERVED_REQUESTS.get(connector, {}).get(shape) if shape else None
