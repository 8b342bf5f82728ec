"""Structural schemas for the custom resources the chart renders.

`kubernetes-validate` only knows built-in kinds, so the Prometheus Operator and KEDA resources
are checked here against the subset of their CRDs' OpenAPI schemas that the chart uses, with
`additionalProperties: false` so a misspelt field fails. Field names and types follow
monitoring.coreos.com/v1 (ServiceMonitor, PrometheusRule) and keda.sh/v1alpha1 (ScaledObject).
"""

from __future__ import annotations

from typing import Any

_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)(y|w|d|h|m|s|ms))+)$"}
_STRMAP = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "minLength": 1}, "labels": _STRMAP},
}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": props}
    if required:
        out["required"] = required
    return out


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _obj(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        ["apiVersion", "kind", "metadata", "spec"],
    )


SERVICE_MONITOR = _resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    _obj(
        {
            "selector": _obj({"matchLabels": _STRMAP}, ["matchLabels"]),
            "namespaceSelector": _obj(
                {"matchNames": {"type": "array", "items": {"type": "string"}}}
            ),
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": _obj(
                    {
                        "port": {"type": "string"},
                        "path": {"type": "string", "pattern": "^/"},
                        "interval": _DURATION,
                        "scrapeTimeout": _DURATION,
                    },
                    ["port"],
                ),
            },
        },
        ["selector", "endpoints"],
    ),
)

PROMETHEUS_RULE = _resource(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    _obj(
        {
            "groups": {
                "type": "array",
                "minItems": 1,
                "items": _obj(
                    {
                        "name": {"type": "string", "minLength": 1},
                        "rules": {
                            "type": "array",
                            "minItems": 1,
                            "items": _obj(
                                {
                                    "alert": {
                                        "type": "string",
                                        "pattern": "^[A-Za-z_][A-Za-z0-9_]*$",
                                    },
                                    "expr": {"type": "string", "minLength": 1},
                                    "for": _DURATION,
                                    "labels": _STRMAP,
                                    "annotations": _STRMAP,
                                },
                                ["alert", "expr"],
                            ),
                        },
                    },
                    ["name", "rules"],
                ),
            }
        },
        ["groups"],
    ),
)

_INT0 = {"type": "integer", "minimum": 0}
SCALED_OBJECT = _resource(
    "keda.sh/v1alpha1",
    "ScaledObject",
    _obj(
        {
            "scaleTargetRef": _obj(
                {
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "name": {"type": "string", "minLength": 1},
                },
                ["name"],
            ),
            "minReplicaCount": _INT0,
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "pollingInterval": _INT0,
            "cooldownPeriod": _INT0,
            "advanced": _obj(
                {
                    "horizontalPodAutoscalerConfig": _obj(
                        {
                            "behavior": _obj(
                                {
                                    "scaleDown": _obj(
                                        {"stabilizationWindowSeconds": _INT0},
                                    )
                                }
                            )
                        }
                    )
                }
            ),
            "triggers": {
                "type": "array",
                "minItems": 1,
                "items": _obj(
                    {
                        "type": {"type": "string"},
                        # KEDA reads every trigger metadata value as a string.
                        "metadata": _STRMAP,
                        "authenticationRef": _obj({"name": {"type": "string"}}, ["name"]),
                    },
                    ["type", "metadata"],
                ),
            },
        },
        ["scaleTargetRef", "triggers"],
    ),
)

#: (apiVersion, kind) -> schema, for every custom resource the chart can render.
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE,
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
}
