"""The Helm chart `helm/lance-sink`, rendered with a real helm binary.

For every scenario in `helm/lance-sink/ci/*.yaml`: `helm lint`, `helm template`, offline
validation of every manifest (`kubernetes-validate` for built-in kinds, the structural schemas
in `tests/helm/crds.py` for the Prometheus Operator and KEDA kinds), and the rendered
`sink.toml` loaded by the real settings loader (`lance-sink check-config`). Then the 1:1
mapping between `values.config` and `config.settings.Settings`, the render-time failures,
the derived numbers and the monitoring assets.

helm comes from `make build/tools/helm` (`make test` depends on it); `LANCE_SINK_HELM`
overrides the path. A missing binary fails these tests, it never skips them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tomllib
import types
import typing
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions
from pydantic import BaseModel, ByteSize, TypeAdapter

from config.settings import QuerySettings, Settings
from tests.helm.crds import CRD_SCHEMAS

pytestmark = pytest.mark.helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "lance-sink"
SCENARIOS = sorted(p.stem for p in (CHART / "ci").glob("*.yaml"))
RELEASE, NAMESPACE = "demo", "streaming"

#: Kubernetes versions the manifests are validated against: the chart's kubeVersion floor and
#: a current release (both must be known to kubernetes-validate; checked below).
KUBE_VERSIONS = ("1.29.0", "1.35.0")
CORE_KINDS = {
    "ConfigMap",
    "Deployment",
    "HorizontalPodAutoscaler",
    "NetworkPolicy",
    "PodDisruptionBudget",
    "Service",
    "ServiceAccount",
    "StatefulSet",
}

#: The metric names the metrics facade exposes (the issue's list); histograms add suffixes.
METRICS = {
    "lance_sink_log_end_offset",
    "lance_sink_consumed_offset",
    "lance_sink_durable_offset",
    "lance_sink_committed_offset",
    "lance_sink_flushed_offset",
    "lance_sink_consumer_lag_messages",
    "lance_sink_durable_lag_messages",
    "lance_sink_commit_lag_messages",
    "lance_sink_flush_lag_messages",
    "lance_sink_lag_seconds",
    "lance_sink_partition_paused",
    "lance_sink_rows_ingested_total",
    "lance_sink_bytes_ingested_total",
    "lance_sink_writer_poisoned",
    "lance_sink_partition_stopped",
    "lance_sink_offsets_skipped_total",
    "lance_sink_dlq_messages_total",
    "lance_sink_dlq_delivery_failures_total",
    "lance_sink_dlq_payload_omitted_total",
    "lance_sink_dlq_held_seconds",
    "lance_sink_wal_unflushed_bytes",
    "lance_sink_wal_sealed_memtables",
    "lance_sink_memtable_bytes",
    "lance_sink_memtable_index_bytes",
    "lance_sink_wal_append_seconds",
    "lance_sink_wal_append_bytes_total",
    "lance_sink_flush_seconds",
    "lance_sink_flush_rows_total",
    "lance_sink_flush_failures_total",
    "lance_sink_replay_seconds",
    "lance_sink_replay_rows_total",
    "lance_sink_wal_backpressure_waits_total",
    "lance_sink_wal_backpressure_wait_seconds_total",
    "lance_sink_wal_backpressure_active_waits",
    "lance_sink_wal_backpressure_rejections_total",
    "lance_sink_budget_used_bytes",
    "lance_sink_budget_bytes",
    "lance_sink_base_unindexed_rows",
    "lance_sink_maintenance_runs_total",
    "lance_sink_maintenance_process_exits_total",
    "lance_sink_maintenance_active",
    "lance_sink_query_seconds",
    "lance_sink_query_unindexed_cache_bytes",
    "lance_sink_query_unindexed_fallbacks_total",
}
HISTOGRAMS = {
    "lance_sink_wal_append_seconds",
    "lance_sink_flush_seconds",
    "lance_sink_query_seconds",
}
MASKED = "**********"
#: Name suffix of the query-only tier's objects (serve.enabled).
SERVE = "-serve"


# ---------------------------------------------------------------- helm and rendering


@pytest.fixture(scope="session")
def helm() -> str:
    path = Path(os.environ.get("LANCE_SINK_HELM") or ROOT / "build" / "tools" / "helm")
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(
            f"helm not found at {path}: run `make build/tools/helm` (make test does) or set "
            "LANCE_SINK_HELM to a helm v3/v4 binary"
        )
    return str(path)


def _helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm, *args], capture_output=True, text=True, timeout=60, check=False, cwd=ROOT
    )


def _template(helm: str, *value_files: Path, extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    args += ["--kube-version", KUBE_VERSIONS[-1]]
    for f in value_files:
        args += ["--values", str(f)]
    proc = _helm(helm, *args, *extra)
    assert proc.returncode == 0, f"helm template failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def _scenario(name: str) -> Path:
    return CHART / "ci" / f"{name}.yaml"


@pytest.fixture(scope="session")
def rendered(helm: str) -> dict[str, list[dict[str, Any]]]:
    """Every scenario rendered once for the whole session."""
    return {name: _template(helm, _scenario(name)) for name in SCENARIOS}


def _one(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    name = f"{RELEASE}-lance-sink{suffix}"
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, got {len(found)}"
    return found[0]


def _workload(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The writers' Deployment or StatefulSet (the serve tier's Deployment is `_serve`'s)."""
    found = [
        d
        for d in docs
        if d["kind"] in {"Deployment", "StatefulSet"} and not d["metadata"]["name"].endswith(SERVE)
    ]
    assert len(found) == 1, [d["kind"] for d in found]
    return found[0]


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = _workload(docs)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return typing.cast("dict[str, Any]", containers[0])


def _sink_toml(docs: list[dict[str, Any]]) -> str:
    return typing.cast("str", _one(docs, "ConfigMap")["data"]["sink.toml"])


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Helm's coalescing of a values file over the chart's values.yaml: maps merge, null deletes."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@cache
def _chart_values() -> dict[str, Any]:
    return typing.cast("dict[str, Any]", yaml.safe_load((CHART / "values.yaml").read_text()))


@cache
def _chart_schema() -> dict[str, Any]:
    return typing.cast("dict[str, Any]", json.loads((CHART / "values.schema.json").read_text()))


def _values(name: str) -> dict[str, Any]:
    return _merge(_chart_values(), yaml.safe_load(_scenario(name).read_text()))


_QUANTITY_SUFFIXES = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def _quantity_bytes(quantity: str | int) -> int:
    """Bytes of a Kubernetes memory quantity (the suffixes the tests use)."""
    if isinstance(quantity, int):
        return quantity
    match = re.fullmatch(r"([0-9.]+)(?:[eE]\+?([0-9]+)|([A-Za-z]*))", quantity)
    assert match, quantity
    number, exponent, suffix = match.groups()
    if exponent is not None:
        return int(float(number) * 10 ** int(exponent))
    return int(float(number) * _QUANTITY_SUFFIXES[suffix])


# ---------------------------------------------------------------- every scenario


def test_scenarios_cover_the_modes() -> None:
    assert set(SCENARIOS) >= {
        "object-storage-values",
        "local-volume-values",
        "keda-values",
        "monitoring-values",
        "sasl-ssl-values",
        "production-values",
        "serve-values",
        "serve-autoscaling-values",
    }


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_helm_lint(helm: str, scenario: str) -> None:
    proc = _helm(helm, "lint", str(CHART), "--strict", "--values", str(_scenario(scenario)))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_kube_versions_are_known_to_the_validator() -> None:
    known = set(all_versions())
    assert set(KUBE_VERSIONS) <= known, f"kubernetes-validate knows {sorted(known)}"


def _validate(doc: dict[str, Any], version: str) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        # Custom resources: kubernetes-validate has no schema for them; check the fields the
        # chart uses against the CRD's structure ourselves.
        jsonschema.validate(doc, CRD_SCHEMAS[key])
        return
    assert doc["kind"] in CORE_KINDS, f"unexpected kind {key}: add it to CORE_KINDS"
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} (k8s {version}): {path}: {exc}")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_manifests_validate(rendered: dict[str, list[dict[str, Any]]], scenario: str) -> None:
    docs = rendered[scenario]
    assert docs
    for doc in docs:
        for version in KUBE_VERSIONS:
            _validate(doc, version)


def test_validation_is_not_vacuous(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """A misspelt field in a core kind and in a custom resource both fail validation."""
    docs = rendered["object-storage-values"]
    bad = copy.deepcopy(_workload(docs))
    bad["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSIONS[-1], strict=True)
    rule = copy.deepcopy(_one(rendered["monitoring-values"], "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["fore"] = "5m"
    with pytest.raises(jsonschema.ValidationError):
        _validate(rule, KUBE_VERSIONS[-1])


def _lance_sink_bin() -> Path:
    exe = Path(sys.executable).parent / "lance-sink"
    if not exe.exists():
        pytest.fail(f"{exe} missing: install the project into the venv (make venv)")
    return exe


def _check_config(
    docs: list[dict[str, Any]], tmp_path: Path
) -> tuple[dict[str, Any], dict[str, str]]:
    """Run `lance-sink check-config` on the rendered sink.toml with the container's
    environment (secret references replaced by placeholders); return the effective config and
    the secret-backed variables that were set."""
    toml_path = tmp_path / "sink.toml"
    toml_path.write_text(_sink_toml(docs))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LANCE_SINK__")}
    from_secrets: dict[str, str] = {}
    for var in _container(docs).get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "secretKeyRef" in var.get("valueFrom", {}):
            from_secrets[var["name"]] = f"placeholder-{var['valueFrom']['secretKeyRef']['key']}"
    env.update(from_secrets)
    proc = subprocess.run(
        [str(_lance_sink_bin()), "check-config", str(toml_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"lance-sink check-config rejected sink.toml:\n{proc.stderr}"
    return json.loads(proc.stdout), from_secrets


def _env_path(var: str) -> list[str]:
    assert var.startswith("LANCE_SINK__"), var
    return [p.lower() for p in var.removeprefix("LANCE_SINK__").split("__")]


def _get(data: Any, path: list[str]) -> Any:
    for part in path:
        data = data[part]
    return data


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rendered_config_loads(
    rendered: dict[str, list[dict[str, Any]]], scenario: str, tmp_path: Path
) -> None:
    """The real loader accepts sink.toml plus the pod's environment, and every secret the pod
    gets from a Secret lands on its settings key (masked in the output)."""
    effective, from_secrets = _check_config(rendered[scenario], tmp_path)
    for var in from_secrets:
        assert _get(effective, _env_path(var)) == MASKED, var


def test_secrets_reach_their_settings(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """Every secret settings field is reachable from values, through secrets.* (env)."""
    effective, from_secrets = _check_config(rendered["sasl-ssl-values"], tmp_path)
    assert set(from_secrets) == {
        "LANCE_SINK__KAFKA__SASL_PASSWORD",
        "LANCE_SINK__KAFKA__SSL_KEY_PASSWORD",
        "LANCE_SINK__QUERY__AUTH_TOKEN",
        "LANCE_SINK__TABLE__STORAGE_OPTIONS__AWS_ACCESS_KEY_ID",
        "LANCE_SINK__TABLE__STORAGE_OPTIONS__AWS_SECRET_ACCESS_KEY",
        "LANCE_SINK__TABLE__STORAGE_OPTIONS__AWS_SESSION_TOKEN",
    }
    kafka = effective["kafka"]
    mount = "/etc/lance-sink/kafka-tls"
    assert kafka["ssl_ca_location"] == f"{mount}/ca.crt"
    assert kafka["ssl_certificate_location"] == f"{mount}/user.crt"
    assert kafka["ssl_key_location"] == f"{mount}/user.key"
    mounts = {m["name"]: m for m in _container(rendered["sasl-ssl-values"])["volumeMounts"]}
    assert mounts["kafka-tls"] == {"name": "kafka-tls", "mountPath": mount, "readOnly": True}


# ---------------------------------------------------------------- values <-> settings, 1:1


def _reaches(value: Any, toml_value: Any, effective: Any, path: str) -> None:
    """`value` (from values.config) is in sink.toml unchanged and in the effective settings."""
    if isinstance(value, dict):
        assert isinstance(toml_value, dict), path
        assert isinstance(effective, dict), path
        for key, sub in value.items():
            if sub is None:
                continue
            assert key in toml_value, f"{path}.{key} is not in sink.toml"
            assert key in effective, f"{path}.{key} is not in the effective config"
            _reaches(sub, toml_value[key], effective[key], f"{path}.{key}")
    elif isinstance(value, list):
        assert isinstance(toml_value, list), path
        assert isinstance(effective, list), path
        assert len(value) == len(toml_value) == len(effective), path
        for i, (v, t, e) in enumerate(zip(value, toml_value, effective, strict=True)):
            _reaches(v, t, e, f"{path}[{i}]")
    else:
        assert toml_value == value, f"{path}: sink.toml has {toml_value!r}, values {value!r}"
        if effective == MASKED:
            return  # a SecretStr (storage_options values): present, masked in the dump
        if isinstance(value, str) and isinstance(effective, int) and not isinstance(value, bool):
            value = TypeAdapter(ByteSize).validate_python(value)
        assert effective == value, f"{path}: effective {effective!r}, values {value!r}"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_values_key_reaches_the_config(
    rendered: dict[str, list[dict[str, Any]]], scenario: str, tmp_path: Path
) -> None:
    config = _values(scenario)["config"]
    toml = tomllib.loads(_sink_toml(rendered[scenario]))
    effective, _ = _check_config(rendered[scenario], tmp_path)
    assert set(toml) == set(config) == set(Settings.model_fields)
    _reaches(config, toml, effective, "config")
    derived = {"ssl_ca_location", "ssl_certificate_location", "ssl_key_location"}
    for section, fields in config.items():
        for key, value in fields.items():
            if value is None and not (section == "kafka" and key in derived):
                assert key not in toml[section], f"null config.{section}.{key} was rendered"


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _nested_models(arg)]


def _literal_values(annotation: Any) -> set[Any] | None:
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    if typing.get_origin(annotation) in {typing.Union, types.UnionType}:
        for arg in typing.get_args(annotation):
            found = _literal_values(arg)
            if found is not None:
                return found
    return None


def _walk_model(model: type[BaseModel], schema: dict[str, Any], path: str) -> Iterator[str]:
    """Check `schema` (a values.schema.json node) against `model` field by field, recursively;
    yield every dotted field path visited."""
    props = schema.get("properties")
    assert props is not None, f"{path}: schema node has no properties"
    assert schema.get("additionalProperties") is False, f"{path}: unknown keys are not rejected"
    assert set(props) == set(model.model_fields), (
        f"{path}: schema keys {sorted(props)} != settings fields {sorted(model.model_fields)}"
    )
    for name, field in model.model_fields.items():
        node = props[name]
        yield f"{path}.{name}"
        literal = _literal_values(field.annotation)
        if literal is not None:
            assert set(node["enum"]) - {None} == literal, f"{path}.{name}: enum differs"
        for sub in _nested_models(field.annotation):
            yield from _walk_model(sub, node.get("items", node), f"{path}.{name}")


def test_every_setting_is_reachable_from_values() -> None:
    """values.yaml's config and values.schema.json's config are exactly the settings tree:
    every section and field (recursively, into columns and vector) and nothing else; the
    values.yaml defaults are the model's defaults; enumerations match."""
    config_schema = _chart_schema()["properties"]["config"]
    visited = set(_walk_model(Settings, config_schema, "config"))
    assert "config.table.columns.nullable" in visited
    assert "config.table.vector.metric" in visited

    values_config = _chart_values()["config"]
    assert set(values_config) == set(Settings.model_fields)
    for section, section_field in Settings.model_fields.items():
        (model,) = _nested_models(section_field.annotation)
        assert set(values_config[section]) == set(model.model_fields), section
        for name, field in model.model_fields.items():
            if field.is_required():
                continue  # values.yaml holds an empty placeholder; the chart requires it
            value = values_config[section][name]
            default = field.get_default(call_default_factory=True, validated_data={})
            if isinstance(default, int) and isinstance(value, str):
                value = TypeAdapter(ByteSize).validate_python(value)
            assert value == default, f"config.{section}.{name}: values {value!r} != {default!r}"


# ---------------------------------------------------------------- render-time failures


INVALID = {
    "unknown config key": (
        {"config": {"kafka": {"bootstrap_server": "typo:9092"}}},
        "additional properties 'bootstrap_server' not allowed",
    ),
    "unknown top-level key": ({"replicas": 3}, "additional properties 'replicas' not allowed"),
    "wrong type": ({"config": {"flush": {"workers": "two"}}}, "/config/flush/workers"),
    "replicas > 1 with local volume": (
        {
            "storage": {"mode": "localVolume"},
            "replicaCount": 2,
            "config": {"table": {"uri": "/data/t.lance"}},
        },
        "storage.mode localVolume runs exactly one pod",
    ),
    "grace period below the drain deadline": (
        {"terminationGracePeriodSeconds": 30, "config": {"shutdown": {"drain_deadline_s": 60}}},
        (
            "terminationGracePeriodSeconds (30) must be greater than "
            "config.shutdown.drain_deadline_s (60)"
        ),
    ),
    "KEDA without partitions": (
        {"keda": {"enabled": True}},
        "keda.enabled needs keda.partitions",
    ),
    "KEDA with a local volume": (
        {
            "storage": {"mode": "localVolume"},
            "replicaCount": 1,
            "keda": {"enabled": True, "partitions": 4},
            "config": {"table": {"uri": "/data/t.lance"}},
        },
        "cannot scale",
    ),
    "inline SASL password": (
        {"config": {"kafka": {"sasl_password": "hunter2"}}},
        "config.kafka.sasl_password must not be set in values",
    ),
    "inline S3 credentials": (
        {"config": {"table": {"storage_options": {"aws_secret_access_key": "x"}}}},
        "storage_options.aws_secret_access_key looks like a credential",
    ),
    "SASL without the password secret": (
        {"config": {"kafka": {"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN"}}},
        "needs the password: set secrets.kafkaSasl.existingSecret",
    ),
    "local path in object storage mode": (
        {"config": {"table": {"uri": "/data/t.lance"}}},
        "storage.mode objectStore keeps the table and the WAL in object storage",
    ),
    "table outside the local volume": (
        {"storage": {"mode": "localVolume"}, "config": {"table": {"uri": "/srv/t.lance"}}},
        "must be a path under storage.localVolume.mountPath (/data/...)",
    ),
    "missing bootstrap servers": (
        {"config": {"kafka": {"bootstrap_servers": ""}}},
        "config.kafka.bootstrap_servers is required",
    ),
    "unparseable budget": (
        {"config": {"backpressure": {"process_budget_bytes": "2 GiBs"}}},
        "process_budget_bytes",
    ),
    "settings in extraEnv": (
        {"extraEnv": [{"name": "LANCE_SINK__KAFKA__GROUP_ID", "value": "x"}]},
        "extraEnv LANCE_SINK__KAFKA__GROUP_ID: settings go under config",
    ),
    "dead letters on the pod's filesystem": (
        {"config": {"dlq": {"lance_table_uri": "/tmp/dlq.lance"}}},
        'config.dlq.lance_table_uri="/tmp/dlq.lance": storage.mode objectStore',
    ),
    "metrics on loopback": (
        {"config": {"observability": {"metrics_host": "127.0.0.1"}}},
        "the kubelet probes /healthz and /readyz",
    ),
    "query and metrics on one port": (
        {"config": {"query": {"port": 9102}}},
        "config.query.port and config.observability.metrics_port are both 9102",
    ),
    "static membership with replicas": (
        {"config": {"kafka": {"group_instance_id": "a"}}},
        "group_instance_id must be unique per pod",
    ),
    "budget above the memory limit": (
        {
            "config": {"backpressure": {"process_budget_bytes": "8GiB"}},
            "resources": {"limits": {"memory": "2Gi"}},
        },
        (
            "config.backpressure.process_budget_bytes (8GiB = 8589934592 bytes) does not fit "
            "in resources.limits.memory (2Gi): the pod needs 14912Mi"
        ),
    ),
    "memory limit below the fixed part": (
        {"resources": {"limits": {"memory": "1Gi"}}},
        "Raise resources.limits.memory to at least 5696Mi, or leave it null",
    ),
    "memory request above the derived limit": (
        {"resources": {"requests": {"memory": "8Gi"}}},
        (
            "resources.requests.memory (8Gi) is above the container's memory limit (5696Mi, "
            "derived from config.backpressure.process_budget_bytes since "
            "resources.limits.memory is null): the API server refuses a pod whose request "
            "exceeds its limit. Lower resources.requests.memory to at most 5696Mi"
        ),
    ),
    "memory request above the set limit": (
        {"resources": {"requests": {"memory": "7Gi"}, "limits": {"memory": "6Gi"}}},
        (
            "resources.requests.memory (7Gi) is above the container's memory limit (6Gi, "
            "resources.limits.memory)"
        ),
    ),
    "CPU request above the CPU limit": (
        {"resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "500m"}}},
        (
            "resources.requests.cpu (1) is above resources.limits.cpu (500m): the API server "
            "refuses a pod whose request exceeds its limit"
        ),
    ),
    "CPU limit that is not a quantity": (
        {"resources": {"limits": {"cpu": "two"}}},
        'resources.limits.cpu: cannot read "two" as a Kubernetes CPU quantity',
    ),
    "memory limit that is not a quantity": (
        {"resources": {"limits": {"memory": "6GB"}}},
        'resources.limits.memory: cannot read "6GB" as a Kubernetes memory quantity',
    ),
    "memtable above what the budget allows": (
        {"config": {"memtable": {"max_bytes": "2GiB"}}},
        (
            "config.memtable.max_bytes (2GiB = 2147483648 bytes) is above what "
            "config.backpressure.process_budget_bytes (2GiB = 2147483648 bytes) allows"
        ),
    ),
    "KEDA on SASL_SSL without authenticationRef": (
        {
            "keda": {"enabled": True, "partitions": 4},
            "config": {
                "kafka": {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512"}
            },
            "secrets": {"kafkaSasl": {"existingSecret": "kafka-user"}},
        },
        "keda.enabled with config.kafka.security_protocol=SASL_SSL needs keda.authenticationRef",
    ),
    "KEDA on SSL without authenticationRef": (
        {
            "keda": {"enabled": True, "partitions": 4},
            "config": {"kafka": {"security_protocol": "SSL"}},
        },
        "security_protocol=SSL needs keda.authenticationRef",
    ),
    "strategy with a local volume": (
        {
            "storage": {"mode": "localVolume"},
            "replicaCount": 1,
            "strategy": {"type": "Recreate"},
            "config": {"table": {"uri": "/data/t.lance"}},
        },
        "strategy applies to the objectStore Deployment only",
    ),
    "Recreate with rollingUpdate": (
        {"strategy": {"type": "Recreate", "rollingUpdate": {"maxSurge": 0}}},
        "strategy.rollingUpdate is only for strategy.type RollingUpdate",
    ),
    "a rollout that can never replace a pod": (
        {"strategy": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": "0%"}}},
        "maxSurge and maxUnavailable cannot both be 0",
    ),
    "unknown strategy key": (
        {"strategy": {"rollingUpdate": {"maxSurges": 0}}},
        "additional properties 'maxSurges' not allowed",
    ),
    "image digest that is not a digest": (
        {"image": {"digest": "4c8ad1c1"}},
        "/image/digest",
    ),
    "topology spread without a topology key": (
        {"topologySpreadConstraints": [{"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}]},
        "missing property 'topologyKey'",
    ),
    "network policy hiding the metrics from Prometheus": (
        {"networkPolicy": {"enabled": True}, "monitoring": {"serviceMonitor": {"enabled": True}}},
        "networkPolicy.enabled with monitoring.serviceMonitor.enabled needs networkPolicy.metrics",
    ),
    "network policy with no egress at all": (
        {"networkPolicy": {"enabled": True, "egress": []}},
        "networkPolicy.egress: [] would block the sink's connections",
    ),
    "unknown network policy peer field": (
        {"networkPolicy": {"enabled": True, "query": {"from": [{"podSelectors": {}}]}}},
        "additional properties 'podSelectors' not allowed",
    ),
    "serve tier on a local volume": (
        {
            "storage": {"mode": "localVolume"},
            "replicaCount": 1,
            "config": {"table": {"uri": "/data/t.lance"}},
            "serve": {"enabled": True},
        },
        (
            "serve.enabled: storage.mode localVolume keeps the table and the WAL on one "
            "ReadWriteOnce volume that only the writer pod mounts"
        ),
    ),
    "serve tier without the query API": (
        {"serve": {"enabled": True}, "config": {"query": {"enabled": False}}},
        "serve.enabled needs config.query.enabled",
    ),
    "serve tier behind a network policy no client may cross": (
        {"serve": {"enabled": True}, "networkPolicy": {"enabled": True}},
        "serve.enabled with networkPolicy.enabled needs networkPolicy.query.from",
    ),
    "serve memory limit below the query caches": (
        {"serve": {"enabled": True, "resources": {"limits": {"memory": "1Gi"}}}},
        (
            "serve.resources.limits.memory (1Gi) cannot hold what a serve pod needs, 1856Mi = "
            "512Mi serve.resources.memory.overheadMiB + 1344Mi for the query API's caches"
        ),
    ),
    "serve memory request above its limit": (
        {"serve": {"enabled": True, "resources": {"requests": {"memory": "4Gi"}}}},
        "serve.resources.requests.memory (4Gi) is above the serve container's memory limit",
    ),
    "serve CPU request above its limit": (
        {"serve": {"enabled": True, "resources": {"limits": {"cpu": "500m"}}}},
        "serve.resources.requests.cpu (1) is above serve.resources.limits.cpu (500m)",
    ),
    "serve autoscaling below one replica": (
        {"serve": {"enabled": True, "autoscaling": {"enabled": True, "minReplicas": 0}}},
        "at '/serve/autoscaling/minReplicas': minimum: got 0, want 1",
    ),
    "serve autoscaling max below min": (
        {
            "serve": {
                "enabled": True,
                "autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 3},
            }
        },
        "serve.autoscaling.maxReplicas (3) is below serve.autoscaling.minReplicas (5)",
    ),
    "serve autoscaling on CPU without a CPU request": (
        {
            "serve": {
                "enabled": True,
                "resources": {"requests": {"cpu": None}},
                "autoscaling": {"enabled": True},
            }
        },
        (
            "serve.autoscaling.targetCPUUtilizationPercentage (70) needs "
            "serve.resources.requests.cpu (above 0)"
        ),
    ),
    "serve autoscaling on CPU with a zero CPU request": (
        {
            "serve": {
                "enabled": True,
                "resources": {"requests": {"cpu": "0"}},
                "autoscaling": {"enabled": True},
            }
        },
        (
            "serve.autoscaling.targetCPUUtilizationPercentage (70) needs "
            "serve.resources.requests.cpu (above 0)"
        ),
    ),
    "serve autoscaling without a target": (
        {
            "serve": {
                "enabled": True,
                "autoscaling": {"enabled": True, "targetCPUUtilizationPercentage": None},
            }
        },
        "serve.autoscaling.enabled needs a target to scale on",
    ),
    "unknown serve autoscaling key": (
        {"serve": {"enabled": True, "autoscaling": {"enabled": True, "maxReplica": 4}}},
        "additional properties 'maxReplica' not allowed",
    ),
    "unknown serve key": (
        {"serve": {"enabled": True, "replica": 2}},
        "additional properties 'replica' not allowed",
    ),
    "serve cache not a size": (
        {"serve": {"unindexedCacheBytes": "lots"}},
        "'lots' does not match pattern",
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_values_fail_with_a_clear_message(helm: str, case: str, tmp_path: Path) -> None:
    override, message = INVALID[case]
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(override))
    proc = _helm(
        helm,
        "template",
        RELEASE,
        str(CHART),
        "--values",
        str(_scenario("object-storage-values")),
        "--values",
        str(path),
    )
    assert proc.returncode != 0, f"{case}: rendered although invalid"
    assert message in proc.stderr, proc.stderr


# ---------------------------------------------------------------- what the pods get


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_pod_hardening_and_probes(rendered: dict[str, list[dict[str, Any]]], scenario: str) -> None:
    docs = rendered[scenario]
    values = _values(scenario)
    pod = _workload(docs)["spec"]["template"]
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    container = _container(docs)
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert container["args"] == ["run", "--config", "/etc/lance-sink/config/sink.toml"]

    port = values["config"]["observability"]["metrics_port"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == port
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    service_ports = {p["name"]: p["port"] for p in _one(docs, "Service")["spec"]["ports"]}
    assert service_ports["metrics"] == port
    if values["config"]["query"]["enabled"]:
        assert service_ports["query"] == ports["query"] == values["config"]["query"]["port"]
    else:
        assert "query" not in service_ports

    sha256_hex = len(hashlib.sha256().hexdigest())
    assert len(pod["metadata"]["annotations"]["checksum/config"]) == sha256_hex
    assert (
        _one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]
        == (_workload(docs)["spec"]["selector"]["matchLabels"])
    )

    drain = values["config"]["shutdown"]["drain_deadline_s"]
    grace = spec["terminationGracePeriodSeconds"]
    assert grace > drain
    if values["terminationGracePeriodSeconds"] is None:
        assert grace == math.ceil(drain) + values["terminationGraceMarginSeconds"]
    else:
        assert grace == values["terminationGracePeriodSeconds"]

    budget = TypeAdapter(ByteSize).validate_python(
        values["config"]["backpressure"]["process_budget_bytes"]
    )
    derived_mib = math.ceil(budget * 1.5 / 2**20) + 768  # overheadMiB
    table = values["config"]["table"]
    if values["config"]["query"]["enabled"] and (table.get("vector") or table.get("fts_columns")):
        cache = TypeAdapter(ByteSize).validate_python(
            values["config"]["query"]["unindexed_cache_bytes"]
        )
        derived_mib += math.ceil(cache / 2**20)
    if values["config"]["query"]["enabled"]:  # the Lance caches of queries on the base
        lance_caches = sum(
            TypeAdapter(ByteSize).validate_python(values["config"]["query"][name])
            for name in ("lance_index_cache_bytes", "lance_metadata_cache_bytes")
        )
        derived_mib += math.ceil(lance_caches / 2**20)
    if values["config"]["maintenance"]["enabled"] and values["config"]["maintenance"]["process"]:
        derived_mib += values["resources"]["memory"]["maintenanceProcessMiB"]
    source = values["config"]["source"]
    if source.get("decode_processes"):
        derived_mib += source["decode_workers"] * values["resources"]["memory"]["decodeProcessMiB"]
    limits = values["resources"]["limits"]
    if limits["memory"] is None:
        assert container["resources"]["limits"]["memory"] == f"{derived_mib}Mi"
        assert container["resources"]["requests"]["memory"] == f"{derived_mib}Mi"
    else:  # set by the operator: rendered as is, and it holds what the budget needs
        assert container["resources"]["limits"]["memory"] == limits["memory"]
        assert _quantity_bytes(limits["memory"]) >= derived_mib * 2**20


def test_memory_limit_formula_and_override(helm: str, tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "config": {
                    "backpressure": {"process_budget_bytes": 3_000_000_000},
                    "query": {"unindexed_cache_bytes": "256MiB"},
                },
                "resources": {
                    "memory": {"budgetFactor": 2, "overheadMiB": 100, "maintenanceProcessMiB": 50}
                },
            }
        )
    )
    assert _values("object-storage-values")["config"]["table"]["vector"]
    docs = _template(helm, _scenario("object-storage-values"), path)
    lance_caches = 256 + 64  # query.lance_index_cache_bytes + lance_metadata_cache_bytes
    assert _container(docs)["resources"]["limits"]["memory"] == (
        f"{math.ceil(3_000_000_000 * 2 / 2**20) + 100 + 256 + lance_caches + 50}Mi"
    )
    # Maintenance in threads of the sink process (or off): no second process.
    for maintenance in ({"process": False}, {"enabled": False}):
        path.write_text(
            yaml.safe_dump(
                {
                    "config": {
                        "backpressure": {"process_budget_bytes": 3_000_000_000},
                        "query": {"unindexed_cache_bytes": "256MiB"},
                        "maintenance": maintenance,
                    },
                    "resources": {
                        "memory": {
                            "budgetFactor": 2,
                            "overheadMiB": 100,
                            "maintenanceProcessMiB": 50,
                        }
                    },
                }
            )
        )
        docs = _template(helm, _scenario("object-storage-values"), path)
        assert _container(docs)["resources"]["limits"]["memory"] == (
            f"{math.ceil(3_000_000_000 * 2 / 2**20) + 100 + 256 + lance_caches}Mi"
        )
    # Without the query API, no unindexed-fragment cache and no Lance caches are held.
    path.write_text(
        yaml.safe_dump(
            {
                "config": {
                    "backpressure": {"process_budget_bytes": 3_000_000_000},
                    "query": {"enabled": False, "unindexed_cache_bytes": "256MiB"},
                    "maintenance": {"enabled": False},
                },
                "resources": {"memory": {"budgetFactor": 2, "overheadMiB": 100}},
            }
        )
    )
    docs = _template(helm, _scenario("object-storage-values"), path)
    assert _container(docs)["resources"]["limits"]["memory"] == (
        f"{math.ceil(3_000_000_000 * 2 / 2**20) + 100}Mi"
    )
    # Decoding in worker processes: each worker's allowance on top.
    path.write_text(
        yaml.safe_dump(
            {
                "config": {
                    "backpressure": {"process_budget_bytes": 3_000_000_000},
                    "query": {"enabled": False},
                    "maintenance": {"enabled": False},
                    "source": {"decode_processes": True, "decode_workers": 3},
                },
                "resources": {
                    "memory": {"budgetFactor": 2, "overheadMiB": 100, "decodeProcessMiB": 70}
                },
            }
        )
    )
    docs = _template(helm, _scenario("object-storage-values"), path)
    assert _container(docs)["resources"]["limits"]["memory"] == (
        f"{math.ceil(3_000_000_000 * 2 / 2**20) + 100 + 3 * 70}Mi"
    )
    path.write_text(yaml.safe_dump({"resources": {"limits": {"memory": "6Gi"}}}))
    resources = _container(_template(helm, _scenario("object-storage-values"), path))["resources"]
    assert resources["limits"]["memory"] == resources["requests"]["memory"] == "6Gi"


def test_memory_limit_from_set_flags(helm: str) -> None:
    """`--set` yields int64 values (files yield float64): both parse alike."""
    docs = _template(
        helm,
        _scenario("object-storage-values"),
        extra=("--set", "config.backpressure.process_budget_bytes=3221225472"),
    )
    cache_mib = 1024  # the default query.unindexed_cache_bytes (the scenario has a vector)
    lance_caches_mib = 256 + 64  # the default Lance index and metadata caches of queries
    maintenance_mib = 512  # maintenance runs in its child process by default
    assert _container(docs)["resources"]["limits"]["memory"] == (
        f"{3 * 1024 * 3 // 2 + 768 + cache_mib + lance_caches_mib + maintenance_mib}Mi"
    )


def test_toml_strings_survive_escaping(helm: str, tmp_path: Path) -> None:
    """Quotes, backslashes, control characters, HTML-ish and non-ASCII text and dotted keys
    come out of sink.toml exactly as they went into values."""
    tricky = 'a "quoted" \\ back\\slash\ttab\nnewline <&> é 漢字'
    override = {
        "config": {
            "kafka": {
                "client_id": tricky,
                "librdkafka": {"client.rack": "eu-west-1a", "fetch.wait.max.ms": 250},
            },
            "source": {"columns": {"body": "@headers.X-Trace.Id"}},
            "dlq": {"topic_template": "dlq.{topic}"},
        }
    }
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(override, allow_unicode=True))
    docs = _template(helm, _scenario("object-storage-values"), path)
    toml = tomllib.loads(_sink_toml(docs))
    assert toml["kafka"]["client_id"] == tricky
    assert toml["kafka"]["librdkafka"] == {
        "client.rack": "eu-west-1a",
        "fetch.wait.max.ms": 250,
        "fetch.max.bytes": 104857600,  # from the scenario file underneath
    }
    assert toml["source"]["columns"]["body"] == "@headers.X-Trace.Id"
    effective, _ = _check_config(docs, tmp_path)
    assert effective["kafka"]["client_id"] == tricky


def test_checksum_follows_the_config_only(helm: str, tmp_path: Path) -> None:
    def checksum(override: dict[str, Any]) -> str:
        path = tmp_path / "values.yaml"
        path.write_text(yaml.safe_dump(override))
        docs = _template(helm, _scenario("object-storage-values"), path)
        meta = _workload(docs)["spec"]["template"]["metadata"]
        return typing.cast("str", meta["annotations"]["checksum/config"])

    base = checksum({})
    assert checksum({"podAnnotations": {"team": "data"}}) == base
    assert checksum({"config": {"flush": {"workers": 2}}}) != base


def test_object_storage_is_a_stateless_deployment(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["object-storage-values"]
    deployment = _one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    assert not any(d["kind"] in {"StatefulSet", "PersistentVolumeClaim"} for d in docs)
    assert "volumeClaimTemplates" not in deployment["spec"]
    env = {e["name"]: e for e in _container(docs)["env"]}
    ref = env["LANCE_SINK__TABLE__STORAGE_OPTIONS__AWS_SECRET_ACCESS_KEY"]["valueFrom"]
    assert ref == {"secretKeyRef": {"name": "lance-sink-s3", "key": "AWS_SECRET_ACCESS_KEY"}}
    assert not any(d["kind"] == "Secret" for d in docs), "the chart never creates Secrets"
    keda = rendered["keda-values"]
    sa = _one(keda, "ServiceAccount")
    assert sa["metadata"]["annotations"] == {
        "eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/lance-sink"
    }
    # IRSA: no static credentials, no secrets; only the pod's advertised query URL.
    env = _container(keda).get("env", [])
    assert {e["name"] for e in env} == {"POD_IP", "LANCE_SINK__QUERY__ADVERTISED_URL"}
    assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in env)


def test_local_volume_is_a_single_pod_statefulset(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["local-volume-values"]
    sts = _one(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == 1
    assert not any(d["kind"] == "Deployment" for d in docs)
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    mounts = {m["name"]: m["mountPath"] for m in _container(docs)["volumeMounts"]}
    assert mounts["data"] == "/data"


def test_keda_scales_on_lag_capped_at_partitions(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["keda-values"]
    assert "replicas" not in _one(docs, "Deployment")["spec"], "KEDA owns the replica count"
    scaled = _one(docs, "ScaledObject")["spec"]
    assert scaled["scaleTargetRef"]["name"] == f"{RELEASE}-lance-sink"
    assert scaled["minReplicaCount"] == 2
    assert scaled["maxReplicaCount"] == 12  # asked for 40, capped at keda.partitions
    triggers = scaled["triggers"]
    assert [t["metadata"]["topic"] for t in triggers] == ["clicks", "views"]
    for trigger in triggers:
        assert trigger["type"] == "kafka"
        assert trigger["metadata"]["consumerGroup"] == "lance-sink"
        assert trigger["metadata"]["bootstrapServers"] == "kafka:9092"
        assert trigger["metadata"]["lagThreshold"] == "50000"
    assert _one(docs, "PodDisruptionBudget")["spec"] == {
        "minAvailable": 1,
        "selector": _one(docs, "Deployment")["spec"]["selector"],
    }


def test_memory_limit_must_hold_the_budget(helm: str, tmp_path: Path) -> None:
    """A set resources.limits.memory renders exactly when it holds what the derived formula
    needs for the budget (whatever the quantity's unit), and fails one MiB below."""
    # the scenario's settings: budget, overhead, unindexed cache, Lance caches, maintenance
    need_mib = math.ceil(2 * 2**30 * 1.5 / 2**20) + 768 + 1024 + 256 + 64 + 512
    path = tmp_path / "values.yaml"

    def renders(limit: str | int) -> bool:
        path.write_text(yaml.safe_dump({"resources": {"limits": {"memory": limit}}}))
        proc = _helm(
            helm, "template", RELEASE, str(CHART), "--values",
            str(_scenario("object-storage-values")), "--values", str(path),
        )  # fmt: skip
        assert proc.returncode == 0 or "does not fit in resources.limits.memory" in proc.stderr, (
            proc.stderr
        )
        return proc.returncode == 0

    assert renders(f"{need_mib}Mi")
    assert not renders(f"{need_mib - 1}Mi")
    assert renders(need_mib * 2**20)
    assert not renders(need_mib * 2**20 - 1)
    assert need_mib == 5696  # 5,972,688,896 bytes
    assert renders("6Gi")
    assert not renders("5Gi")
    assert renders("6G")  # 6e9 bytes
    assert not renders("5.9G")  # 5.9e9 bytes
    assert renders("60e8")
    assert not renders("59e8")
    assert renders("5.98e+09")


def test_memtable_rule_mirrors_the_settings(helm: str, tmp_path: Path) -> None:
    """The chart refuses memtable.max_bytes above half the budget exactly where the settings
    model (what the pod runs at start) refuses it, and accepts what the model accepts."""
    path = tmp_path / "values.yaml"
    budget = 1 << 30
    for memtable, ok in ((budget // 2, True), (budget // 2 + 1, False)):
        override = {
            "config": {
                "backpressure": {"process_budget_bytes": budget},
                "memtable": {"max_bytes": memtable},
            }
        }
        path.write_text(yaml.safe_dump(override))
        args = [
            "template",
            RELEASE,
            str(CHART),
            "--values",
            str(_scenario("object-storage-values")),
        ]
        proc = _helm(helm, *args, "--values", str(path))
        assert (proc.returncode == 0) is ok, proc.stderr
        if ok:
            docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
            _check_config(docs, tmp_path)  # the loader accepts it too
            toml = tomllib.loads(_sink_toml(docs))
        else:
            assert "is above what config.backpressure.process_budget_bytes" in proc.stderr
            # The same settings, past the chart: the sink refuses to start on them.
            toml["memtable"]["max_bytes"] = memtable
            bad = tmp_path / "bad.toml"
            bad.write_text(_toml_dump(toml))
            env = {k: v for k, v in os.environ.items() if not k.startswith("LANCE_SINK__")}
            checked = subprocess.run(
                [str(_lance_sink_bin()), "check-config", str(bad)],
                capture_output=True, text=True, env=env, timeout=60, check=False,
            )  # fmt: skip
            assert checked.returncode == 2, checked.stderr
            assert "backpressure.process_budget_bytes" in checked.stderr
            assert "at least 2 x memtable.max_bytes" in checked.stderr


def _toml_dump(data: dict[str, Any]) -> str:
    """sink.toml from its parsed form: sections of scalars, lists and inline tables."""

    def value(v: Any) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items()) + "}"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v)

    return "".join(
        f"[{section}]\n" + "".join(f"{json.dumps(k)} = {value(v)}\n" for k, v in fields.items())
        for section, fields in data.items()
    )


def test_production_scenario(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The operator's knobs: digest pin, surge 0, own spread constraints, NetworkPolicy with
    restricted egress, KEDA through a TriggerAuthentication."""
    docs = rendered["production-values"]
    values = _values("production-values")
    deployment = _one(docs, "Deployment")
    assert _container(docs)["image"] == (
        "registry.example.com/data/lance-sink@" + values["image"]["digest"]
    )
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    selector = deployment["spec"]["selector"]
    zone, host = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert zone == {
        "maxSkew": 1,
        "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": selector,  # filled in: the constraint had none
    }
    assert host["labelSelector"] == {"matchLabels": {"app.kubernetes.io/name": "lance-sink"}}
    for trigger in _one(docs, "ScaledObject")["spec"]["triggers"]:
        assert trigger["authenticationRef"] == {"name": "kafka-scaler-auth"}

    policy = _one(docs, "NetworkPolicy")["spec"]
    sink_pods = {"podSelector": selector}
    assert policy["podSelector"] == selector
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    query, metrics = policy["ingress"]
    assert query["ports"] == [{"port": 8080, "protocol": "TCP"}]
    assert query["from"] == [sink_pods, *values["networkPolicy"]["query"]["from"]]
    assert metrics["ports"] == [{"port": 9102, "protocol": "TCP"}]
    assert metrics["from"] == values["networkPolicy"]["metrics"]["from"]
    fan_out, *rules = policy["egress"]
    assert fan_out == {"ports": [{"port": 8080, "protocol": "TCP"}], "to": [sink_pods]}
    assert rules == values["networkPolicy"]["egress"]


def test_default_pod_spread_and_no_network_policy(
    helm: str, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """By default the pods spread softly over zones and nodes (Deployment and StatefulSet),
    the image goes by tag, the strategy is Kubernetes' own, and there is no NetworkPolicy;
    [] turns the spread off."""
    for scenario in ("object-storage-values", "local-volume-values"):
        docs = rendered[scenario]
        workload = _workload(docs)
        constraints = workload["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert [(c["topologyKey"], c["whenUnsatisfiable"], c["maxSkew"]) for c in constraints] == [
            ("topology.kubernetes.io/zone", "ScheduleAnyway", 1),
            ("kubernetes.io/hostname", "ScheduleAnyway", 1),
        ]
        for c in constraints:
            assert c["labelSelector"] == workload["spec"]["selector"]
        assert "strategy" not in workload["spec"]
        assert _container(docs)["image"] == "lance-sink:0.1.0"
        assert not any(d["kind"] == "NetworkPolicy" for d in docs)
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"topologySpreadConstraints": []}))
    docs = _template(helm, _scenario("object-storage-values"), path)
    assert "topologySpreadConstraints" not in _workload(docs)["spec"]["template"]["spec"]


def test_network_policy_defaults(helm: str, tmp_path: Path) -> None:
    """Enabled with no peers: the query port is open to the sink's own pods only, nothing may
    scrape, egress stays open; without the query API and peers, no ingress at all."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"networkPolicy": {"enabled": True}}))
    docs = _template(helm, _scenario("object-storage-values"), path)
    policy = _one(docs, "NetworkPolicy")["spec"]
    selector = _workload(docs)["spec"]["selector"]
    assert policy["policyTypes"] == ["Ingress"]
    assert "egress" not in policy
    assert policy["ingress"] == [
        {"ports": [{"port": 8080, "protocol": "TCP"}], "from": [{"podSelector": selector}]}
    ]
    for version in KUBE_VERSIONS:
        _validate(_one(docs, "NetworkPolicy"), version)
    docs = _template(helm, _scenario("local-volume-values"), path)  # query API off
    policy = _one(docs, "NetworkPolicy")["spec"]
    assert policy["ingress"] == []
    for version in KUBE_VERSIONS:
        _validate(_one(docs, "NetworkPolicy"), version)


def test_pods_advertise_their_ip_for_fan_out_reads(helm: str, tmp_path: Path) -> None:
    """Each pod records http://<pod IP>:<query port> in the shard manifests it claims (the
    downward API), unless config.query.advertised_url is set; no query API, no URL."""
    docs = _template(helm, _scenario("object-storage-values"))
    env = {v["name"]: v for v in _container(docs)["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["LANCE_SINK__QUERY__ADVERTISED_URL"]["value"] == "http://$(POD_IP):8080"
    names = [v["name"] for v in _container(docs)["env"]]
    assert names.index("POD_IP") < names.index("LANCE_SINK__QUERY__ADVERTISED_URL")
    # On an IPv6 cluster the kubelet makes it http://fd00::1:8080, which the sink advertises
    # bracketed (urllib3 refused it unbracketed on every fan-out request to the pod).
    url = env["LANCE_SINK__QUERY__ADVERTISED_URL"]["value"].replace("$(POD_IP)", "fd00::1")
    assert QuerySettings(advertised_url=url).advertised_url == "http://[fd00::1]:8080"
    path = tmp_path / "values.yaml"
    path.write_text(
        yaml.safe_dump({"config": {"query": {"advertised_url": "http://sink-0.sink:8080"}}})
    )
    docs = _template(helm, _scenario("object-storage-values"), path)
    names = [v["name"] for v in _container(docs).get("env", [])]
    assert "LANCE_SINK__QUERY__ADVERTISED_URL" not in names
    assert 'advertised_url = "http://sink-0.sink:8080"' in _sink_toml(docs)
    docs = _template(helm, _scenario("local-volume-values"))  # query API off
    names = [v["name"] for v in _container(docs).get("env", [])]
    assert "LANCE_SINK__QUERY__ADVERTISED_URL" not in names


def test_local_volume_has_a_headless_governing_service(
    helm: str, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The StatefulSet's serviceName is a headless Service selecting its pod, published before
    it is ready, without the metrics port (scraped through the ordinary Service only)."""
    assert not any(
        d["metadata"]["name"].endswith("-headless") for d in rendered["object-storage-values"]
    )
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"config": {"query": {"enabled": True}}}))
    query_off = rendered["local-volume-values"]
    query_on = _template(helm, _scenario("local-volume-values"), path)
    for docs, ports in ((query_off, []), (query_on, [("query", 8080)])):
        sts = _one(docs, "StatefulSet")
        headless = _one(docs, "Service", "-headless")
        assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["publishNotReadyAddresses"] is True
        assert headless["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
        found = [(p["name"], p["port"]) for p in headless["spec"].get("ports", [])]
        assert found == ports
        assert _one(docs, "Service")["spec"].get("clusterIP") != "None"
        for version in KUBE_VERSIONS:
            _validate(headless, version)


# ---------------------------------------------------------------- the query-only tier


def _serve(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _one(docs, "Deployment", SERVE)


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether a matchLabels selector selects an object with these labels."""
    return selector.items() <= labels.items()


def test_serve_tier_is_off_by_default(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Without serve.enabled nothing of the tier renders: no object named or labelled for
    it, no pod running `lance-sink serve`, no peer for it in the NetworkPolicy."""
    assert _chart_values()["serve"]["enabled"] is False
    for scenario, docs in rendered.items():
        if _values(scenario)["serve"]["enabled"]:
            continue
        text = yaml.safe_dump_all(docs)
        assert not any(d["metadata"]["name"].endswith(SERVE) for d in docs), scenario
        assert "lance-sink-serve" not in text, scenario
        assert "component: serve" not in text, scenario
        assert _container(docs)["args"][0] == "run"


def test_serve_tier_deployment_and_service(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """serve.enabled: a Deployment of `lance-sink serve` pods with the writers' config, secrets,
    probes and hardening, and a Service selecting them only; the two tiers' selectors (workload,
    Service, PodDisruptionBudget) never select the other tier's pods."""
    docs = rendered["serve-values"]
    values = _values("serve-values")
    serve, writers = _serve(docs), _workload(docs)
    assert writers["kind"] == "Deployment"
    assert serve["spec"]["replicas"] == 3
    assert writers["spec"]["replicas"] == 2
    pod, writer_pod = serve["spec"]["template"], writers["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    writer = _container(docs)
    assert container["args"] == ["serve", "--config", "/etc/lance-sink/config/sink.toml"]
    assert container["image"] == writer["image"]
    assert container["securityContext"] == writer["securityContext"]
    assert pod["spec"]["securityContext"] == writer_pod["spec"]["securityContext"]
    assert pod["spec"]["volumes"] == writer_pod["spec"]["volumes"]  # the same ConfigMap
    assert container["volumeMounts"] == writer["volumeMounts"]
    assert pod["metadata"]["annotations"] == writer_pod["metadata"]["annotations"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe] == writer[probe]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "metrics": values["config"]["observability"]["metrics_port"],
        "query": values["config"]["query"]["port"],
    }
    # The same secrets by reference; no advertised URL (a serve pod claims no shard).
    env = {e["name"]: e for e in container["env"]}
    writer_env = {e["name"]: e for e in writer["env"]}
    assert set(writer_env) - set(env) == {"POD_IP", "LANCE_SINK__QUERY__ADVERTISED_URL"}
    assert env == {k: v for k, v in writer_env.items() if k in env}
    assert env["LANCE_SINK__QUERY__AUTH_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "lance-sink-query", "key": "token"}
    }
    # Memory: the query caches (1 GiB unindexed rows with a vector column, 256 + 64 MiB Lance
    # caches) + serve.resources.memory.overheadMiB; no budget, maintenance or decoding.
    assert container["resources"] == {
        "requests": {"cpu": "500m", "memory": "1856Mi"},
        "limits": {"cpu": "2", "memory": "1856Mi"},
    }

    service, writer_service = _one(docs, "Service", SERVE), _one(docs, "Service")
    assert service["spec"]["selector"] == serve["spec"]["selector"]["matchLabels"]
    assert {(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        ("query", 8080, "query"),
        ("metrics", 9102, "metrics"),
    }
    serve_pdb, writer_pdb = (
        _one(docs, "PodDisruptionBudget", SERVE),
        _one(docs, "PodDisruptionBudget"),
    )
    assert serve_pdb["spec"] == {"maxUnavailable": 1, "selector": serve["spec"]["selector"]}
    serve_labels, writer_labels = pod["metadata"]["labels"], writer_pod["metadata"]["labels"]
    for selector in (
        serve["spec"]["selector"]["matchLabels"],
        service["spec"]["selector"],
        serve_pdb["spec"]["selector"]["matchLabels"],
    ):
        assert _selects(selector, serve_labels)
        assert not _selects(selector, writer_labels)
    for selector in (
        writers["spec"]["selector"]["matchLabels"],
        writer_service["spec"]["selector"],
        writer_pdb["spec"]["selector"]["matchLabels"],
    ):
        assert _selects(selector, writer_labels)
        assert not _selects(selector, serve_labels)
    for constraint in pod["spec"]["topologySpreadConstraints"]:  # spread among serve pods
        assert constraint["labelSelector"] == serve["spec"]["selector"]


def test_serve_pods_can_hold_more_unindexed_rows_than_the_writers(
    helm: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    """serve.unindexedCacheBytes: the serve pods' own query.unindexed_cache_bytes (by the
    environment; the writers keep config.query's), counted in their derived memory limit
    (a value that is no size: `INVALID`)."""
    docs = _template(
        helm, _scenario("serve-values"), extra=("--set", "serve.unindexedCacheBytes=3GiB")
    )
    (container,) = _serve(docs)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LANCE_SINK__QUERY__UNINDEXED_CACHE_BYTES"] == "3GiB"
    assert "LANCE_SINK__QUERY__UNINDEXED_CACHE_BYTES" not in {
        e["name"] for e in _container(docs)["env"]
    }
    # 3072 MiB unindexed rows + 256 + 64 MiB Lance caches + 512 MiB overhead.
    assert container["resources"]["limits"]["memory"] == "3904Mi"
    assert _container(docs)["resources"] == _container(rendered["serve-values"])["resources"]
    # 0 turns the serve pods' cache off (and out of their memory limit).
    off = _template(helm, _scenario("serve-values"), extra=("--set", "serve.unindexedCacheBytes=0"))
    (container,) = _serve(off)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LANCE_SINK__QUERY__UNINDEXED_CACHE_BYTES"] == "0"
    assert container["resources"]["limits"]["memory"] == "832Mi"


def test_serve_tier_network_policy_and_monitoring(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The writers' policy lets serve pods reach the query port (fan-out); the serve pods'
    policy lets the query clients in and the serve pods out to the writers' query port; a
    second ServiceMonitor scrapes the serve Service only."""
    docs = rendered["serve-values"]
    values = _values("serve-values")
    np_values = values["networkPolicy"]
    serve_selector = _serve(docs)["spec"]["selector"]
    writer_selector = _workload(docs)["spec"]["selector"]
    query_port = [{"port": 8080, "protocol": "TCP"}]
    metrics_port = [{"port": 9102, "protocol": "TCP"}]

    writers = _one(docs, "NetworkPolicy")["spec"]
    assert writers["podSelector"] == writer_selector
    query, _metrics = writers["ingress"]
    assert query["ports"] == query_port
    assert query["from"] == [
        {"podSelector": writer_selector},
        {"podSelector": serve_selector},
        *np_values["query"]["from"],
    ]

    serve = _one(docs, "NetworkPolicy", SERVE)["spec"]
    assert serve["podSelector"] == serve_selector
    assert serve["policyTypes"] == ["Ingress", "Egress"]
    assert serve["ingress"] == [
        {"ports": query_port, "from": np_values["query"]["from"]},
        {"ports": metrics_port, "from": np_values["metrics"]["from"]},
    ]
    fan_out, *rules = serve["egress"]
    assert fan_out == {"ports": query_port, "to": [{"podSelector": writer_selector}]}
    assert rules == np_values["egress"]

    monitor = _one(docs, "ServiceMonitor", SERVE)["spec"]
    serve_service, writer_service = _one(docs, "Service", SERVE), _one(docs, "Service")
    assert _selects(monitor["selector"]["matchLabels"], serve_service["metadata"]["labels"])
    assert not _selects(monitor["selector"]["matchLabels"], writer_service["metadata"]["labels"])
    writer_monitor = _one(docs, "ServiceMonitor")["spec"]["selector"]["matchLabels"]
    assert not _selects(writer_monitor, serve_service["metadata"]["labels"])
    assert monitor["endpoints"] == _one(docs, "ServiceMonitor")["spec"]["endpoints"]


# ---------------------------------------------------------------- monitoring


def _metrics_in(text: str) -> set[str]:
    names = set()
    for name in re.findall(r"\blance_sink_[a-z_]+", text):
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        names.add(base if base in HISTOGRAMS else name)
    return names


def test_alerts(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["monitoring-values"]
    rule = _one(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(rules) == {
        "LanceSinkCommitLagGrowing",
        "LanceSinkPartitionPaused",
        "LanceSinkFlushFailing",
        "LanceSinkWriterPoisoned",
        "LanceSinkPartitionStopped",
        "LanceSinkOffsetsSkipped",
        "LanceSinkDeadLetterRate",
        "LanceSinkDeadLettersStalled",
        "LanceSinkNoMaintenance",
    }
    selector = f'{{job="{RELEASE}-lance-sink",namespace="{NAMESPACE}"}}'
    lag = rules["LanceSinkCommitLagGrowing"]["expr"]
    assert f"lance_sink_commit_lag_messages{selector} > 2000000" in lag
    assert f"delta(lance_sink_commit_lag_messages{selector}[10m]) > 0" in lag
    assert rules["LanceSinkPartitionPaused"]["for"] == "10m"
    assert "lance_sink_flush_failures_total" in rules["LanceSinkFlushFailing"]["expr"]
    assert "lance_sink_writer_poisoned" in rules["LanceSinkWriterPoisoned"]["expr"]
    assert rules["LanceSinkPartitionStopped"]["expr"] == (
        f"lance_sink_partition_stopped{selector} > 0"
    )
    assert rules["LanceSinkOffsetsSkipped"]["expr"] == (
        f"increase(lance_sink_offsets_skipped_total{selector}[1h]) > 0"
    )
    assert rules["LanceSinkDeadLetterRate"]["expr"].endswith("> 0.5")
    assert rules["LanceSinkDeadLettersStalled"]["expr"] == (
        f"lance_sink_dlq_held_seconds{selector} > 120"
    )
    assert rules["LanceSinkNoMaintenance"]["expr"] == (
        f"max by (namespace) (lance_sink_maintenance_active{selector}) == 0"
    )
    assert rules["LanceSinkNoMaintenance"]["for"] == "30m"
    for r in rules.values():
        assert _metrics_in(r["expr"]) <= METRICS, r["alert"]
        assert r["labels"]["severity"]

    monitor = _one(docs, "ServiceMonitor")["spec"]
    assert monitor["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
    ]
    assert monitor["selector"]["matchLabels"] == _one(docs, "Service")["spec"]["selector"]


def test_alert_summaries_name_what_the_metrics_label(helm: str) -> None:
    """Per partition, a summary names the topic-partition (the flush alert the shard); with
    `observability.partition_metrics = "topic"` those metrics carry the topic only, and the
    summaries said `orders/` and `(shard )`: they name the topic instead."""

    def summaries(*extra: str) -> dict[str, str]:
        docs = _template(helm, _scenario("monitoring-values"), extra=extra)
        rule = _one(docs, "PrometheusRule")
        return {
            r["alert"]: r["annotations"]["summary"]
            for g in rule["spec"]["groups"]
            for r in g["rules"]
        }

    per_partition = summaries()
    assert (
        "partition {{ $labels.topic }}/{{ $labels.partition }}"
        in (per_partition["LanceSinkPartitionStopped"])
    )
    assert "(shard {{ $labels.shard }})" in per_partition["LanceSinkFlushFailing"]
    by_topic = summaries("--set", "config.observability.partition_metrics=topic")
    assert set(by_topic) == set(per_partition)
    for alert, summary in by_topic.items():
        assert "$labels.partition" not in summary, alert
        assert "$labels.shard" not in summary, alert
    assert "topic {{ $labels.topic }}'s partitions" in by_topic["LanceSinkPartitionStopped"]
    assert "a shard of topic {{ $labels.topic }}" in by_topic["LanceSinkFlushFailing"]


def test_no_maintenance_alert_only_where_maintenance_runs(helm: str) -> None:
    """With config.maintenance.enabled false, the gauge is 0 on every pod by design: the
    alert would always fire, so it is not rendered."""
    docs = _template(
        helm,
        _scenario("monitoring-values"),
        extra=("--set", "config.maintenance.enabled=false"),
    )
    rule = _one(docs, "PrometheusRule")
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert "LanceSinkNoMaintenance" not in alerts
    assert "LanceSinkWriterPoisoned" in alerts


def test_grafana_dashboard(rendered: dict[str, list[dict[str, Any]]]) -> None:
    cm = _one(rendered["monitoring-values"], "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Kafka"}
    dashboard = json.loads(cm["data"]["lance-sink.json"])
    assert dashboard["uid"] == "lance-sink"
    exprs = [t["expr"] for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]
    assert exprs
    used = _metrics_in("\n".join(exprs))
    assert used <= METRICS, f"unknown metrics: {sorted(used - METRICS)}"
    assert used == METRICS, f"metrics without a panel: {sorted(METRICS - used)}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for scenario, docs in rendered.items():
        monitoring = _values(scenario)["monitoring"]
        rendered_kinds = {
            "ServiceMonitor": any(d["kind"] == "ServiceMonitor" for d in docs),
            "PrometheusRule": any(d["kind"] == "PrometheusRule" for d in docs),
            "dashboard": any(d["metadata"]["name"].endswith("-dashboard") for d in docs),
        }
        assert rendered_kinds == {
            "ServiceMonitor": monitoring["serviceMonitor"]["enabled"],
            "PrometheusRule": monitoring["prometheusRule"]["enabled"],
            "dashboard": monitoring["grafanaDashboard"]["enabled"],
        }, f"{scenario}: monitoring objects are opt-in"


def _hpas(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]


def test_serve_autoscaling_is_off_by_default(
    helm: str, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """Without serve.autoscaling.enabled no HorizontalPodAutoscaler renders and the serve
    Deployment (when serve.enabled) keeps its fixed serve.replicas."""
    assert _chart_values()["serve"]["autoscaling"]["enabled"] is False
    for scenario, docs in rendered.items():
        values = _values(scenario)
        if values["serve"]["autoscaling"]["enabled"]:
            continue
        assert _hpas(docs) == [], scenario
        if values["serve"]["enabled"]:
            assert _serve(docs)["spec"]["replicas"] == values["serve"]["replicas"], scenario
    assert "serve-values" in rendered  # the serve tier on, autoscaling left at its default
    # Asked for explicitly off: the same.
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"serve": {"autoscaling": {"enabled": False}}}))
    docs = _template(helm, _scenario("serve-values"), path)
    assert _hpas(docs) == []
    assert _serve(docs)["spec"]["replicas"] == 3


def test_serve_autoscaling_hpa_owns_the_serve_replicas(
    helm: str, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """serve.autoscaling.enabled: an autoscaling/v2 HorizontalPodAutoscaler targets the serve
    Deployment (never the writers'), with the values' bounds and one Utilization metric per
    target; the serve Deployment leaves replicas to it, the writers keep theirs."""
    docs = rendered["serve-autoscaling-values"]
    values = _values("serve-autoscaling-values")["serve"]["autoscaling"]
    serve, writers = _serve(docs), _workload(docs)
    assert "replicas" not in serve["spec"], "the HorizontalPodAutoscaler owns the replica count"
    assert writers["spec"]["replicas"] == 2
    (hpa,) = _hpas(docs)
    assert hpa == _one(docs, "HorizontalPodAutoscaler", SERVE)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["metadata"]["labels"] == serve["metadata"]["labels"]
    assert hpa["spec"] == {
        "scaleTargetRef": {
            "apiVersion": serve["apiVersion"],
            "kind": serve["kind"],
            "name": serve["metadata"]["name"],
        },
        "minReplicas": values["minReplicas"],
        "maxReplicas": values["maxReplicas"],
        "metrics": [
            {
                "type": "Resource",
                "resource": {
                    "name": name,
                    "target": {"type": "Utilization", "averageUtilization": target},
                },
            }
            for name, target in (("cpu", 60), ("memory", 85))
        ],
    }
    assert (values["minReplicas"], values["maxReplicas"]) == (2, 8)
    # Utilization is a share of the request: the serve container requests both.
    (container,) = serve["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["cpu"] == "500m"
    assert container["resources"]["requests"]["memory"]
    for version in KUBE_VERSIONS:
        _validate(hpa, version)
    bad = copy.deepcopy(hpa)
    bad["spec"]["minReplica"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSIONS[0], strict=True)

    # On memory only, the CPU request may be null; the chart's defaults (2..10 on 70% CPU).
    path = tmp_path / "values.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "serve": {
                    "resources": {"requests": {"cpu": None}},
                    "autoscaling": {
                        "targetCPUUtilizationPercentage": None,
                        "targetMemoryUtilizationPercentage": 75,
                    },
                }
            }
        )
    )
    docs = _template(helm, _scenario("serve-autoscaling-values"), path)
    (hpa,) = _hpas(docs)
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["memory"]
    assert hpa["spec"]["metrics"][0]["resource"]["target"]["averageUtilization"] == 75
    assert (
        "cpu"
        not in _serve(docs)["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    )
    for doc in docs:
        for version in KUBE_VERSIONS:
            _validate(doc, version)
    defaults = _chart_values()["serve"]["autoscaling"]
    path.write_text(yaml.safe_dump({"serve": {"autoscaling": {"enabled": True}}}))
    (hpa,) = _hpas(_template(helm, _scenario("serve-values"), path))
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 10)
    assert defaults["targetMemoryUtilizationPercentage"] is None
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Resource",
            "resource": {
                "name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": 70},
            },
        }
    ]


# ---------------------------------------------------------------- docs of the chart


def test_every_value_has_a_comment() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    key = re.compile(r"^\s*[A-Za-z_][A-Za-z0-9_.\"/-]*:(\s|$)")
    missing = []
    for i, line in enumerate(lines):
        if not key.match(line) or "#" in line:
            continue
        previous = next((p for p in reversed(lines[:i]) if p.strip()), "")
        if not previous.lstrip().startswith("#"):
            missing.append(f"values.yaml:{i + 1}: {line.strip()}")
    assert not missing, "keys without a comment:\n" + "\n".join(missing)


def test_schema_rejects_unknown_keys_everywhere() -> None:
    """additionalProperties is false on every object node that lists properties."""

    def walk(node: Any, path: str) -> Iterator[str]:
        if isinstance(node, dict):
            if "properties" in node and node.get("additionalProperties") is not False:
                yield path
            for k, v in node.items():
                yield from walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                yield from walk(v, f"{path}/{i}")

    assert list(walk(_chart_schema(), "")) == []


def test_notes_explain_how_to_see_lag(helm: str) -> None:
    proc = _helm(
        helm,
        "install",
        RELEASE,
        str(CHART),
        "--dry-run=client",
        "--namespace",
        NAMESPACE,
        "--values",
        str(_scenario("object-storage-values")),
    )
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n {NAMESPACE} port-forward svc/{RELEASE}-lance-sink 9102:metrics" in notes
    assert "curl -s localhost:9102/metrics | grep" in notes
    assert "lag_messages" in notes
    assert "lance-sink lag --config /etc/lance-sink/config/sink.toml" in notes
    assert f"port-forward svc/{RELEASE}-lance-sink 8080:query" in notes


def test_notes_point_queries_at_the_serve_service(helm: str) -> None:
    proc = _helm(
        helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
        "--values", str(_scenario("serve-values")),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert f"port-forward svc/{RELEASE}-lance-sink-serve 8080:query" in notes
    assert "3 `lance-sink serve` pod(s)" in notes


def test_notes_give_the_serve_autoscaling_range(helm: str) -> None:
    proc = _helm(
        helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
        "--values", str(_scenario("serve-autoscaling-values")),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert f"port-forward svc/{RELEASE}-lance-sink-serve 8080:query" in notes
    assert "2 to 8 (scaled by a HorizontalPodAutoscaler) `lance-sink serve` pod(s)" in notes


def test_registry_format_derives_columns_and_gets_its_secrets(helm: str, tmp_path: Path) -> None:
    """A registry format may leave table.columns empty (derived at start), and the registry's
    credentials reach their settings from secrets.schemaRegistry, never the ConfigMap."""
    docs = _template(
        helm,
        _scenario("object-storage-values"),
        extra=(
            "--set-json", "config.table.columns=[]",
            "--set", "config.table.evolve=true",
            "--set", "config.source.format=avro",
            "--set", "config.source.schema_registry.url=https://registry:8081",
            "--set", "config.source.schema_registry.basic_auth_username=sink",
            "--set", "secrets.schemaRegistry.existingSecret=registry",
            "--set", "secrets.schemaRegistry.basicAuthPasswordKey=password",
        ),
    )  # fmt: skip
    effective, from_secrets = _check_config(docs, tmp_path)
    assert "LANCE_SINK__SOURCE__SCHEMA_REGISTRY__BASIC_AUTH_PASSWORD" in from_secrets
    assert effective["source"]["schema_registry"]["basic_auth_password"] == MASKED
    assert effective["source"]["schema_registry"]["url"] == "https://registry:8081"
    assert effective["table"]["evolve"] is True
    assert "password" not in _sink_toml(docs)
    proc = _helm(
        helm, "template", RELEASE, str(CHART), "--values", str(_scenario("object-storage-values")),
        "--set-json", "config.table.columns=[]",
    )  # fmt: skip
    assert proc.returncode != 0
    assert "only the registry formats" in proc.stderr
