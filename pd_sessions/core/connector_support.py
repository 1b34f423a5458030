"""What each KV connector supports, checked by the planner before anything launches.

Pure. The rules are data in each connector's spec (``limits`` in pd_sessions/core/connectors/):
vLLM 0.32's connectors map prefill TP ranks onto decode TP ranks (heterogeneous TP, "LBHNC"
layout) when one TP size divides the other, in both directions (``tp_size % remote_tp_size == 0``
or ``remote_tp_size % tp_size == 0`` is asserted in their TP mapping), and serve several prefill
and several decode instances behind one router; a connector says what it cannot do, and what it
cannot do on a platform (``limits.refuse``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from packaging.version import InvalidVersion, Version

from pd_sessions.core import connectors, known_issues
from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.errors import PlanError


def check(config: ClusterConfig, platform: str | None = None) -> None:
    """Raise PlanError naming the connector and the pair when ``config`` asks for what its
    connector cannot do (on ``platform``, when given).

        connector unknown to the registry                    -> ConfigError "connector"
        the connector refuses the platform (limits.refuse)   -> PlanError (its field and reason)
        prefill TP == decode TP                              -> ok
        TP differs, connector without heterogeneous TP       -> PlanError
        TP differs, neither size divides the other (TP2+TP3) -> PlanError (asserted by vLLM)
        several instances per role, connector without xPyD  -> PlanError
    """
    c = config
    spec = connectors.get(c.connector)
    if platform is not None and (refusal := spec.limits.refuse(c, platform)):
        raise PlanError(refusal.field, refusal.message)
    pair = f"prefill TP{c.prefill_tp} + decode TP{c.decode_tp}"
    if c.prefill_tp != c.decode_tp:
        if not spec.limits.hetero_tp:
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
    if (c.num_prefill > 1 or c.num_decode > 1) and not spec.limits.many_per_role:
        raise PlanError(
            "num_prefill" if c.num_prefill > 1 else "num_decode",
            f"{c.name}: connector {c.connector} does not support several instances per "
            f"role ({c.num_prefill}P{c.num_decode}D)",
        )


# Models with linear-attention (SSM) layers beside MLA layers, like Kimi-Linear. A local model
# directory is recognised by its config.json (see :func:`is_hybrid_mla`).
HYBRID_MLA_MODELS = frozenset({"moonshotai/Kimi-Linear-48B-A3B-Instruct", "tiny-kimi-linear"})

# A connector's ``limits.hybrid_mla_hetero_tp`` says when a vLLM cannot feed a lower-TP decode rank
# from a higher-TP prefill for such a model (over NIXL before 0.27.0: seen on the lent H200 x2 with
# vLLM 0.26.0, docs/notes/gpu-verification.md; the first transfer killed the decode's worker).


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

        connector without the limit, or not hybrid MLA      -> None
        prefill TP <= decode TP (per decode rank)           -> None
        vLLM version unknown or not a version               -> None (vLLM itself will say)
        vLLM >= the connector's fixed_in                    -> None (fixed upstream)
        otherwise                                           -> the pair, the version, what goes
                                                               wrong, the fix, and what to change
    """
    c = config
    spec = connectors.get(c.connector)
    limit = spec.limits.hybrid_mla_hetero_tp
    if limit is None or not hybrid_mla or c.prefill_tp <= c.decode_tp or not vllm_version:
        return None
    try:
        if Version(vllm_version) >= Version(limit.fixed_in):
            return None
    except InvalidVersion:
        return None
    return (
        f"{c.name}: vLLM {vllm_version} cannot pull KV over {spec.title} from prefill TP{c.prefill_tp} "
        f"into decode TP{c.decode_tp} ranks for {c.model} (SSM + MLA layers): {limit.why}. Fixed in "
        f"vLLM >= {limit.fixed_in} ({limit.fix}); with this vLLM use --set prefill_tp={c.decode_tp}"
        + (f" ({known_issues.cite(limit.known_issue)})" if limit.known_issue else "")
    )


def vllm_lacks_connector(
    config: ClusterConfig, factory_source: str | None, vllm_version: str | None
) -> str | None:
    """Why the installed vLLM cannot start ``config``'s connector at all, or None. Checked before
    launch: ``factory_source`` is the text of that vLLM's kv_connector/factory.py.

        factory source unknown (None)                    -> None (vLLM itself will say)
        the connector's class registered there           -> None
        otherwise                                        -> the class, the vLLM, where it was added
    """
    spec = connectors.get(config.connector)
    if factory_source is None or re.search(rf'register_connector\(\s*"{spec.vllm_class}"', factory_source):
        return None
    added = f" (added by {spec.added_by})" if spec.added_by else ""
    return (
        f"{config.name}: the installed vLLM {vllm_version or '(version unknown)'} does not register "
        f"{spec.vllm_class} in its connector factory{added}: install a vLLM that has it, or run "
        "another connector (--set connector=...)"
    )


def unserved_request(connector: str, shape: str) -> str | None:
    """Why ``connector`` cannot serve requests of ``shape`` (e.g. "n>1"), or None: its spec's
    ``limits.unserved_requests``."""
    if not shape:
        return None
    return dict(connectors.get(connector).limits.unserved_requests).get(shape)
