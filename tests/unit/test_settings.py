"""The settings model and loader: examples, precedence, secrets, and every kind of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import urllib3

from config import ConfigError, load_settings, problem_at, redacted
from config.settings import LIBRDKAFKA_SECRET_KEYS, MASK, is_secret_librdkafka_key
from engine.engine import writer_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "config" / "examples"

MINIMAL = """
[kafka]
bootstrap_servers = "localhost:9092"
topics = ["events"]

[table]
uri = "./data/events.lance"
columns = [{ name = "id", type = "string" }, { name = "body", type = "string" }]
"""


def write(tmp_path: Path, text: str, name: str = "sink.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(path: Path, overrides: list[str] | None = None) -> list[tuple[str, str, str]]:
    with pytest.raises(ConfigError) as info:
        load_settings(path, overrides)
    return [(p.key, p.origin, p.reason) for p in info.value.problems]


@pytest.mark.parametrize(
    "name", ["quickstart.toml", "production.toml", "avro.toml", "postgres-cdc.toml"]
)
def test_examples_load(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANCE_SINK__KAFKA__SASL_PASSWORD", "hunter2")  # production: SCRAM
    if name == "avro.toml":
        monkeypatch.setenv("LANCE_SINK__SOURCE__SCHEMA_REGISTRY__BASIC_AUTH_PASSWORD", "pw")
    settings = load_settings(EXAMPLES / name)
    assert settings.kafka.topics
    assert settings.table.columns


def test_avro_example_takes_the_registry_password_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LANCE_SINK__SOURCE__SCHEMA_REGISTRY__BASIC_AUTH_PASSWORD", "pw")
    settings = load_settings(EXAMPLES / "avro.toml")
    registry = settings.source.schema_registry
    assert registry is not None
    assert registry.client_conf()["basic.auth.user.info"] == "lance-sink:pw"
    assert "pw" not in json.dumps(redacted(settings))


def test_production_example_uses_s3_and_env_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANCE_SINK__KAFKA__SASL_PASSWORD", "hunter2")
    monkeypatch.setenv("LANCE_SINK__TABLE__STORAGE_OPTIONS__AWS_SECRET_ACCESS_KEY", "s3cr3t")
    settings = load_settings(EXAMPLES / "production.toml")
    assert settings.table.uri.startswith("s3://")
    assert settings.kafka.sasl_password is not None
    assert settings.kafka.sasl_password.get_secret_value() == "hunter2"
    secret = settings.table.storage_options["aws_secret_access_key"]
    assert secret.get_secret_value() == "s3cr3t"
    dumped = json.dumps(redacted(settings))
    assert "hunter2" not in dumped
    assert "s3cr3t" not in dumped
    assert "region" in dumped  # non-secret options stay in the dump key-wise


def test_defaults_fill_unset_keys(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, MINIMAL))
    assert settings.kafka.group_id == "lance-sink"
    assert settings.wal.max_wal_flush_interval_ms == 20
    assert settings.wal_uri == "./data/events.lance/_lance_sink"
    assert settings.table.mode == "append"


def test_precedence_file_env_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, MINIMAL + "\n[wal]\nmax_wal_flush_interval_ms = 7\n")
    assert load_settings(path).wal.max_wal_flush_interval_ms == 7  # file beats default
    monkeypatch.setenv("LANCE_SINK__WAL__MAX_WAL_FLUSH_INTERVAL_MS", "11")
    assert load_settings(path).wal.max_wal_flush_interval_ms == 11  # env beats file
    cli = load_settings(path, ["wal.max_wal_flush_interval_ms=13"])
    assert cli.wal.max_wal_flush_interval_ms == 13  # CLI beats env


def test_yaml_config(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "kafka:\n  bootstrap_servers: b:9092\n  topics: [a]\n"
        "table:\n  uri: s3://bucket/t.lance\n  columns:\n    - {name: x, type: int64}\n",
        "sink.yaml",
    )
    settings = load_settings(path)
    assert settings.table.columns[0].type == "int64"


def test_settings_are_frozen(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, MINIMAL))
    with pytest.raises(ValueError, match="frozen"):
        settings.kafka.group_id = "other"  # type: ignore[misc]


def test_librdkafka_pass_through_accepts_known_keys(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + '\n[kafka.librdkafka]\n"fetch.max.bytes" = 1048576\n')
    assert load_settings(path).kafka.librdkafka == {"fetch.max.bytes": 1048576}


# --- bad input: every case names the key, the source and the reason --------------------


def test_unknown_key(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL.replace('topics = ["events"]', 'topics = ["e"]\ntopix = 1'))
    assert problems(path) == [("kafka.topix", f"file {path}", "Extra inputs are not permitted")]


def test_unknown_section(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "\n[walx]\na = 1\n")
    [(key, origin, reason)] = problems(path)
    assert (key, origin) == ("walx", f"file {path}")
    assert "not permitted" in reason


def test_wrong_type(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + '\n[memtable]\nmax_rows = "lots"\n')
    [(key, origin, reason)] = problems(path)
    assert (key, origin) == ("memtable.max_rows", f"file {path}")
    assert "valid integer" in reason


def test_missing_required_key(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL.replace('bootstrap_servers = "localhost:9092"\n', ""))
    assert problems(path) == [
        ("kafka.bootstrap_servers", f"not set in file {path}", "required key is missing")
    ]


def test_missing_required_section(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL.split("[table]", maxsplit=1)[0])
    assert problems(path) == [("table", f"not set in file {path}", "required key is missing")]


@pytest.mark.parametrize(
    ("uri", "reason"),
    [
        ("gs://bucket/t", "unsupported URI scheme 'gs'"),
        ("s3:///t.lance", "needs a bucket"),
        ("s3://bucket//t.lance", "empty segment"),
        ("s3://bucket/a//t.lance/", "empty segment"),
    ],
)
def test_bad_uri(tmp_path: Path, uri: str, reason: str) -> None:
    path = write(tmp_path, MINIMAL.replace("./data/events.lance", uri))
    [(key, origin, message)] = problems(path)
    assert (key, origin) == ("table.uri", f"file {path}")
    assert reason in message


def test_unknown_librdkafka_key(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + '\n[kafka.librdkafka]\n"fetch.max.bites" = 1\n')
    [(key, origin, reason)] = problems(path)
    assert (key, origin) == ("kafka.librdkafka", f"file {path}")
    assert "fetch.max.bites" in reason
    assert "No such configuration property" in reason


def test_invalid_librdkafka_value(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + '\n[kafka.librdkafka]\n"fetch.max.bytes" = "many"\n')
    [(key, _origin, reason)] = problems(path)
    assert key == "kafka.librdkafka"
    assert "Invalid value" in reason


#: A PKCS#12 keystore (SSL clusters): librdkafka refuses the location without the password.
KEYSTORE = '"ssl.keystore.location" = "client.p12"\n"ssl.keystore.password" = "ks-s3cr3t"\n'


@pytest.mark.parametrize("section", ["kafka.librdkafka", "dlq.librdkafka"])
def test_librdkafka_keys_are_checked_with_their_companions(tmp_path: Path, section: str) -> None:
    """A key valid only with a companion passes when the pair is given: the keys are checked
    together, as the clients get them (each alone, the location was refused, so an SSL
    cluster with a keystore could not be configured)."""
    settings = load_settings(write(tmp_path, MINIMAL + f"\n[{section}]\n{KEYSTORE}"))
    passed = settings.kafka.librdkafka if section == "kafka.librdkafka" else settings.dlq.librdkafka
    assert passed == {"ssl.keystore.location": "client.p12", "ssl.keystore.password": "ks-s3cr3t"}


def test_a_refused_set_of_librdkafka_keys_names_the_offender(tmp_path: Path) -> None:
    """Checked together, a refused set still names the key at fault: the one missing its
    companion, or the one with a bad value beside a right pair; never a secret's value."""
    alone = write(tmp_path, MINIMAL + '\n[kafka.librdkafka]\n"ssl.keystore.location" = "c.p12"\n')
    [(key, origin, reason)] = problems(alone)
    assert (key, origin) == ("kafka.librdkafka", f"file {alone}")
    assert reason.startswith("'ssl.keystore.location': librdkafka says")
    assert "ssl.keystore.password" in reason
    text = MINIMAL + f'\n[kafka.librdkafka]\n{KEYSTORE}"fetch.max.bytes" = "many"\n'
    [(key, _origin, reason)] = problems(write(tmp_path, text, "bad.toml"))
    assert key == "kafka.librdkafka"
    assert reason.startswith("'fetch.max.bytes': librdkafka says")
    assert "Invalid value" in reason
    assert "ks-s3cr3t" not in reason


@pytest.mark.parametrize("owned", ["enable.auto.commit", "group.id", "enable.auto.offset.store"])
def test_sink_owned_librdkafka_key(tmp_path: Path, owned: str) -> None:
    path = write(tmp_path, MINIMAL + f'\n[kafka.librdkafka]\n"{owned}" = "false"\n')
    [(key, _origin, reason)] = problems(path)
    assert key == "kafka.librdkafka"
    assert f"{owned!r} cannot be passed through" in reason


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("memtable", "max_bytes", "-5"),
        ("memtable", "max_rows", "-1"),
        ("wal", "max_wal_buffer_size", "0"),
        ("backpressure", "process_budget_bytes", "-1"),
    ],
)
def test_negative_sizes(tmp_path: Path, section: str, key: str, value: str) -> None:
    path = write(tmp_path, MINIMAL + f"\n[{section}]\n{key} = {value}\n")
    [(problem_key, origin, _reason)] = problems(path)
    assert (problem_key, origin) == (f"{section}.{key}", f"file {path}")


def test_flush_interval_zero_with_durable_writes(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "\n[wal]\nmax_wal_flush_interval_ms = 0\n")
    [(key, origin, reason)] = problems(path)
    assert (key, origin) == ("wal.max_wal_flush_interval_ms", f"file {path}")
    assert "durable_writes" in reason
    relaxed = write(
        tmp_path, MINIMAL + "\n[wal]\ndurable_writes = false\nmax_wal_flush_interval_ms = 0\n"
    )
    assert load_settings(relaxed).wal.max_wal_flush_interval_ms == 0


def test_upsert_needs_primary_key(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL.replace("[table]", '[table]\nmode = "upsert"'))
    [(key, _origin, reason)] = problems(path)
    assert key == "table.primary_key"
    assert "upsert" in reason


def test_fts_column_must_be_a_string_column(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL.replace("[table]", '[table]\nfts_columns = ["nope"]'))
    [(key, _origin, reason)] = problems(path)
    assert key == "table.fts_columns"
    assert "'nope'" in reason


def test_scalar_indexes_name_table_columns_and_kinds(tmp_path: Path) -> None:
    good = MINIMAL + '\n[maintenance.scalar_indexes]\nid = "BTREE"\nbody = "BITMAP"\n'
    assert load_settings(write(tmp_path, good)).maintenance.scalar_indexes == {
        "id": "BTREE",
        "body": "BITMAP",
    }
    path = write(tmp_path, MINIMAL + '\n[maintenance.scalar_indexes]\nnope = "BITMAP"\n')
    [(key, origin, reason)] = problems(path)
    assert (key, origin) == ("maintenance.scalar_indexes", f"file {path}")
    assert reason == "not scalar table columns: nope"
    path = write(tmp_path, MINIMAL + '\n[maintenance.scalar_indexes]\nbody = "HASH"\n')
    [(key, _origin, reason)] = problems(path)
    assert key == "maintenance.scalar_indexes.body"
    assert "'BTREE' or 'BITMAP'" in reason


def test_checks_across_sections_name_their_key(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + '\n[source.columns]\nnope = "$.x"\n')
    [(key, origin, reason)] = problems(path)
    assert (key, origin) == ("source.columns", f"file {path}")
    assert reason == "maps unknown table columns: nope"
    path = write(tmp_path, MINIMAL)
    [(key, origin, reason)] = problems(
        path, ["backpressure.process_budget_bytes=1000", "memtable.max_bytes=1000"]
    )
    assert (key, origin) == (
        "backpressure.process_budget_bytes",
        "flag --set backpressure.process_budget_bytes",
    )
    assert reason.startswith("must be at least 2 x memtable.max_bytes")


def test_env_value_is_named_as_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANCE_SINK__MEMTABLE__MAX_ROWS", "zero")
    [(key, origin, _reason)] = problems(write(tmp_path, MINIMAL))
    assert (key, origin) == ("memtable.max_rows", "environment LANCE_SINK__MEMTABLE__MAX_ROWS")


def test_cli_override_is_named_as_the_source(tmp_path: Path) -> None:
    [(key, origin, _reason)] = problems(write(tmp_path, MINIMAL), ["query.port=99999"])
    assert (key, origin) == ("query.port", "flag --set query.port")


def test_several_problems_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "\n[memtable]\nmax_rows = -1\nmax_batches = 0\n")
    assert {p[0] for p in problems(path)} == {"memtable.max_rows", "memtable.max_batches"}


def test_unparseable_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[kafka\n")
    [(key, origin, reason)] = problems(path)
    assert (key, origin) == ("", f"file {path}")
    assert reason.startswith("cannot parse")


def sasl(mechanism: str) -> str:
    """MINIMAL on a SASL_SSL connection with `mechanism` and a user name, no password."""
    return MINIMAL.replace(
        'topics = ["events"]',
        'topics = ["events"]\nsecurity_protocol = "SASL_SSL"\n'
        f'sasl_mechanism = "{mechanism}"\nsasl_username = "sink"',
    )


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_password_mechanisms_need_the_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mechanism: str
) -> None:
    path = write(tmp_path, sasl(mechanism))
    assert problems(path) == [
        (
            "kafka.sasl_password",
            f"not set in file {path}",
            f"required with sasl_mechanism {mechanism} (the brokers would refuse to authenticate)",
        )
    ]
    monkeypatch.setenv("LANCE_SINK__KAFKA__SASL_PASSWORD", "")
    [(key, origin, _reason)] = problems(path)
    assert (key, origin) == ("kafka.sasl_password", "environment LANCE_SINK__KAFKA__SASL_PASSWORD")
    monkeypatch.setenv("LANCE_SINK__KAFKA__SASL_PASSWORD", "hunter2")
    assert load_settings(path).kafka.sasl_password is not None


def test_sasl_password_mechanisms_need_the_username(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LANCE_SINK__KAFKA__SASL_PASSWORD", "hunter2")
    path = write(tmp_path, sasl("PLAIN").replace('sasl_username = "sink"', ""))
    [(key, origin, reason)] = problems(path)
    assert (key, origin) == ("kafka.sasl_username", f"not set in file {path}")
    assert reason.startswith("required with sasl_mechanism PLAIN")


def test_oauthbearer_and_plaintext_need_no_password(tmp_path: Path) -> None:
    oauth = sasl("OAUTHBEARER").replace('sasl_username = "sink"', "")
    assert load_settings(write(tmp_path, oauth)).kafka.sasl_password is None
    # A mechanism left over from a SASL setup does nothing on a PLAINTEXT connection.
    plain = sasl("PLAIN").replace("SASL_SSL", "PLAINTEXT")
    assert load_settings(write(tmp_path, plain, "plain.toml")).kafka.sasl_password is None


def test_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "sink.toml"
    data = MINIMAL.encode() + b'\n[kafka.librdkafka]\n"client.rack" = "z\xe9ro"\n'  # latin-1
    path.write_bytes(data)
    [(key, origin, reason)] = problems(path)
    assert (key, origin) == ("", f"file {path}")
    line = MINIMAL.count("\n") + 3
    assert reason == (
        f"not valid UTF-8: byte 0xe9 at line {line} (byte offset {data.index(0xE9)}); "
        "save the file as UTF-8"
    )


def test_controller_module_must_import(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + '\n[backpressure]\ncontroller = "nosuchmod:factory"\n')
    assert problems(path) == [
        (
            "backpressure.controller",
            f"file {path}",
            "cannot import module 'nosuchmod': ModuleNotFoundError: No module named 'nosuchmod'",
        )
    ]
    [(_key, _origin, reason)] = problems(
        write(tmp_path, MINIMAL), ["backpressure.controller=engine.backpressure:nope"]
    )
    assert reason == "module 'engine.backpressure' has no attribute 'nope'"
    [(_key, _origin, reason)] = problems(
        write(tmp_path, MINIMAL), ["backpressure.controller=config.settings:ENV_PREFIX"]
    )
    assert reason.endswith("is not callable (a factory is called with the limits)")


SECRET_PASS_THROUGH = {
    "sasl.oauthbearer.client.secret": "oidc-s3cr3t",
    "ssl.keystore.password": "ks-s3cr3t",
    "sasl.oauthbearer.config": "principal=admin-s3cr3t",
    "sasl.oauthbearer.assertion.private.key.passphrase": "pp-s3cr3t",
}


def test_librdkafka_secrets_are_masked(tmp_path: Path) -> None:
    lines = "".join(f'"{k}" = "{v}"\n' for k, v in SECRET_PASS_THROUGH.items())
    text = MINIMAL + f'\n[kafka.librdkafka]\n"fetch.max.bytes" = 1048576\n{lines}'
    settings = load_settings(write(tmp_path, text))
    assert settings.kafka.librdkafka["ssl.keystore.password"] == "ks-s3cr3t"  # clients get it
    shown = redacted(settings)["kafka"]["librdkafka"]
    assert shown == {"fetch.max.bytes": 1048576} | dict.fromkeys(SECRET_PASS_THROUGH, MASK)


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("sasl.password", True),
        ("ssl.key.password", True),
        ("ssl.key.pem", True),
        ("ssl.keystore.password", True),
        ("sasl.oauthbearer.client.secret", True),
        ("sasl.oauthbearer.client.credentials.client.secret", True),
        ("sasl.oauthbearer.assertion.private.key.pem", True),
        ("sasl.oauthbearer.config", True),
        ("SASL.Password", True),
        ("some.future.token", True),
        ("sasl.oauthbearer.token.endpoint.url", False),
        ("sasl.oauthbearer.client.credentials.client.id", False),
        ("sasl.oauthbearer.client.id", False),
        ("ssl.certificate.pem", False),
        ("ssl.keystore.location", False),
        ("fetch.max.bytes", False),
    ],
)
def test_which_librdkafka_keys_hold_secrets(key: str, secret: bool) -> None:
    assert is_secret_librdkafka_key(key) is secret


def test_every_secret_property_librdkafka_knows_is_masked() -> None:
    """Every name in `LIBRDKAFKA_SECRET_KEYS` is a property of the librdkafka the sink runs on
    (a typo would leave the real one in clear)."""
    import confluent_kafka  # noqa: PLC0415

    unknown = []
    for key in LIBRDKAFKA_SECRET_KEYS:
        try:
            confluent_kafka.Producer({key: "x"})
        except confluent_kafka.KafkaException as exc:
            if "No such configuration property" in exc.args[0].str():
                unknown.append(key)
    assert unknown == []


# --- the CLI -------------------------------------------------------------------------------


def cli(
    *args: str, pythonpath: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LANCE_SINK__")} | (env or {})
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [sys.executable, "-m", "sink.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
        check=False,
    )


def test_check_config_prints_redacted_effective_config() -> None:
    result = cli(
        "check-config", str(EXAMPLES / "quickstart.toml"), "--set", "query.auth_token=tok3n"
    )
    assert result.returncode == 0, result.stderr
    effective = json.loads(result.stdout)
    assert effective["kafka"]["topics"] == ["reviews"]
    assert effective["memtable"]["max_bytes"] == 128 << 20
    assert effective["query"]["auth_token"] == "**********"
    assert "tok3n" not in result.stdout


def test_check_config_invalid_exits_2_naming_key_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "\n[memtable]\nmax_rows = -1\n")
    result = cli("check-config", str(path))
    assert result.returncode == 2
    assert "memtable.max_rows" in result.stderr
    assert str(path) in result.stderr
    assert "Traceback" not in result.stderr


def test_check_config_missing_file_exits_2(tmp_path: Path) -> None:
    result = cli("check-config", str(tmp_path / "absent.toml"))
    assert result.returncode == 2
    assert "cannot read" in result.stderr
    assert "Traceback" not in result.stderr


def test_version() -> None:
    result = cli("--version")
    assert result.returncode == 0
    assert result.stdout.startswith("lance-sink ")


def test_the_writer_tuning_comes_from_the_settings(tmp_path: Path) -> None:
    """Each seal limit, the max age included, reaches the shard writers' configuration."""
    text = MINIMAL + "\n[memtable]\nmax_rows = 1234\nmax_batches = 56\nmax_age_s = 7\n"
    config = writer_config(load_settings(write(tmp_path, text)))
    assert (config.limits.max_rows, config.limits.max_batches) == (1234, 56)
    assert config.max_age_s == 7
    default = writer_config(load_settings(write(tmp_path, MINIMAL, "default.toml")))
    assert default.max_age_s == 300


def test_check_config_sasl_without_password_exits_2(tmp_path: Path) -> None:
    path = write(tmp_path, sasl("SCRAM-SHA-512"))
    result = cli("check-config", str(path))
    assert result.returncode == 2
    assert f"kafka.sasl_password (not set in file {path}): required" in result.stderr
    assert "Traceback" not in result.stderr


def test_check_config_not_utf8_exits_2_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sink.toml"
    path.write_bytes(MINIMAL.encode("utf-16"))
    result = cli("check-config", str(path))
    assert result.returncode == 2
    assert f"<root> (file {path}): not valid UTF-8: byte 0xff at line 1" in result.stderr
    assert "Traceback" not in result.stderr


CONTROLLERS = """
from engine.backpressure import BudgetController


def good(process_budget_bytes, max_unflushed_memtable_bytes):
    return BudgetController(process_budget_bytes)


def broken(process_budget_bytes, max_unflushed_memtable_bytes):
    raise RuntimeError("no license for the controller")


def wrong(process_budget_bytes, max_unflushed_memtable_bytes):
    return object()
"""


@pytest.mark.parametrize("command", ["check-config", "run"])
def test_controller_that_cannot_import_exits_2(tmp_path: Path, command: str) -> None:
    path = write(tmp_path, MINIMAL + '\n[backpressure]\ncontroller = "nosuchmod:factory"\n')
    result = cli(command, *(["--config"] if command == "run" else []), str(path))
    assert result.returncode == 2, result.stderr
    assert (
        f"backpressure.controller (file {path}): cannot import module 'nosuchmod'" in result.stderr
    )
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("factory", "reason"),
    [
        ("broken", "the factory failed: RuntimeError: no license for the controller"),
        ("wrong", "the factory failed: TypeError: my_controllers:wrong did not return a"),
    ],
)
def test_check_config_calls_the_controller_factory(
    tmp_path: Path, factory: str, reason: str
) -> None:
    (tmp_path / "my_controllers.py").write_text(CONTROLLERS)
    path = write(tmp_path, MINIMAL)
    good = cli(
        "check-config",
        str(path),
        "--set",
        "backpressure.controller=my_controllers:good",
        pythonpath=tmp_path,
    )
    assert good.returncode == 0, good.stderr
    result = cli(
        "check-config",
        str(path),
        "--set",
        f"backpressure.controller=my_controllers:{factory}",
        pythonpath=tmp_path,
    )
    assert result.returncode == 2
    assert f"backpressure.controller (flag --set backpressure.controller): {reason}" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


def test_librdkafka_secrets_never_print(tmp_path: Path) -> None:
    """Neither `check-config` nor `run`'s `config_loaded` line shows a pass-through secret
    (`run` here stops at the controller check, after logging its configuration)."""
    (tmp_path / "my_controllers.py").write_text(CONTROLLERS)
    lines = "".join(f'"{k}" = "{v}"\n' for k, v in SECRET_PASS_THROUGH.items())
    path = write(tmp_path, MINIMAL + f"\n[kafka.librdkafka]\n{lines}")
    checked = cli("check-config", str(path))
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout)["kafka"]["librdkafka"] == dict.fromkeys(
        SECRET_PASS_THROUGH, MASK
    )
    run = cli(
        "run",
        "--config",
        str(path),
        "--set",
        "backpressure.controller=my_controllers:broken",
        "--set",
        "observability.log_format=json",
        pythonpath=tmp_path,
    )
    assert run.returncode == 2, run.stderr
    [loaded] = [
        json.loads(line)
        for line in run.stderr.splitlines()
        if line.startswith("{") and '"config_loaded"' in line
    ]
    assert loaded["config"]["kafka"]["librdkafka"] == dict.fromkeys(SECRET_PASS_THROUGH, MASK)
    for secret in SECRET_PASS_THROUGH.values():
        assert secret not in checked.stdout + checked.stderr + run.stdout + run.stderr


def test_advertised_url_reaches_the_shard_writers(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + '\n[query]\nadvertised_url = "http://10.1.2.3:8080"\n')
    settings = load_settings(path)
    assert writer_config(settings).advertised_url == "http://10.1.2.3:8080"
    assert writer_config(load_settings(write(tmp_path, MINIMAL, "b.toml"))).advertised_url == ""


def test_advertised_url_must_be_an_http_url(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + '\n[query]\nadvertised_url = "10.1.2.3:8080"\n')
    [(key, origin, reason)] = problems(path)
    assert (key, origin) == ("query.advertised_url", f"file {path}")
    assert "pattern" in reason


@pytest.mark.parametrize(
    ("url", "advertised"),
    [
        # What the chart's http://$(POD_IP):8080 becomes on an IPv6 pod: bracketed.
        ("http://fd00::1:8080", "http://[fd00::1]:8080"),
        ("http://fd00:10:244::1a:8080/sink", "http://[fd00:10:244::1a]:8080/sink"),
        ("https://2001:db8:0:0:0:0:0:1:443", "https://[2001:db8:0:0:0:0:0:1]:443"),
        # Already bracketed, IPv4 and names: unchanged.
        ("http://[fd00::1]:8080", "http://[fd00::1]:8080"),
        ("http://[fd00::1]", "http://[fd00::1]"),
        ("http://10.1.2.3:8080", "http://10.1.2.3:8080"),
        ("http://sink-0.sink-headless:8080", "http://sink-0.sink-headless:8080"),
    ],
)
def test_an_ipv6_advertised_url_is_bracketed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, advertised: str
) -> None:
    """On an IPv6 cluster the chart advertised http://fd00::1:8080, which the pattern let
    through and urllib3 refused (LocationParseError) on every fan-out request to that pod:
    an unbracketed IPv6 address followed by :port is bracketed when the settings load."""
    monkeypatch.setenv("LANCE_SINK__QUERY__ADVERTISED_URL", url)
    settings = load_settings(write(tmp_path, MINIMAL))
    assert settings.query.advertised_url == advertised
    assert writer_config(settings).advertised_url == advertised  # what the manifests record
    parsed = urllib3.util.parse_url(advertised.rstrip("/") + "/internal/v1/fresh")
    assert parsed.host is not None


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://fd00::1", "'fd00::1' is ambiguous: an IPv6 address goes in brackets"),
        ("http://fd00::abcd", "'fd00::abcd' is ambiguous"),
        ("http://fd00::8080", "'fd00::8080' is ambiguous"),
        ("http://fd00::1:99999", "'fd00::1:99999': the port must be a number from 1 to 65535"),
        ("http://[fd00::1]:0", "'[fd00::1]:0': the port must be a number from 1 to 65535"),
        ("http://[10.1.2.3]:8080", "the host in brackets must be an IPv6 address"),
        ("http://[fd00::1]8080", "only ':port' may follow the brackets"),
        ("http://10.1.2.3:80a", "'10.1.2.3:80a': the port must be a number from 1 to 65535"),
    ],
)
def test_an_ambiguous_advertised_url_is_a_config_error(tmp_path: Path, url: str, says: str) -> None:
    path = write(tmp_path, MINIMAL + f'\n[query]\nadvertised_url = "{url}"\n')
    [(key, origin, reason)] = problems(path)
    assert (key, origin) == ("query.advertised_url", f"file {path}")
    assert says in reason, reason


@pytest.mark.parametrize(
    ("topics", "says"),
    [
        (
            ["ev ents"],
            (
                "'ev ents' is not a legal Kafka topic name: it holds characters Kafka "
                "refuses in a topic name: ' '"
            ),
        ),
        (["events", "a/b"], "'a/b' is not a legal Kafka topic name: it holds characters"),
        (["."], "'.' is not a legal Kafka topic name"),
        (["e" * 250], "is not a legal Kafka topic name: it is 250 characters long"),
    ],
)
def test_an_illegal_topic_name_is_reported_at_kafka_topics(
    tmp_path: Path, topics: list[str], says: str
) -> None:
    """An illegal topic was blamed on `dlq.topic_template (not set in file)`, through the
    dead-letter topic derived from it (or, as '.', passed: '..dlq' is legal)."""
    text = MINIMAL.replace('topics = ["events"]', f"topics = {json.dumps(topics)}")
    path = write(tmp_path, text)
    [(key, origin, reason)] = problems(path)  # nothing about dlq.topic_template
    assert (key, origin) == ("kafka.topics", f"file {path}")
    assert says in reason, reason
    # Without a dead-letter topic too: the name itself is illegal.
    with pytest.raises(ConfigError):
        load_settings(path, ["dlq.enabled=false"])


def test_a_regex_subscription_is_not_checked_as_a_topic_name(tmp_path: Path) -> None:
    text = MINIMAL.replace('topics = ["events"]', 'topics = ["^ev ents-.*", "orders"]')
    settings = load_settings(write(tmp_path, text))
    assert settings.kafka.topics == ["^ev ents-.*", "orders"]


def test_a_misspelled_environment_section_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LANCE_SINK__MEMTABEL__MAX_ROWS` was ignored without a word (pydantic-settings reads
    the variables of known sections only), where a misspelled key in a known section is
    refused: it names the variable, with the other problems."""
    monkeypatch.setenv("LANCE_SINK__MEMTABEL__MAX_ROWS", "5")
    path = write(tmp_path, MINIMAL)
    [(key, origin, reason)] = problems(path)
    assert (key, origin) == ("memtabel", "environment LANCE_SINK__MEMTABEL__MAX_ROWS")
    assert reason.startswith(
        "'memtabel' is not a section of the settings (did you mean "
        "LANCE_SINK__MEMTABLE? the sections are kafka, source, table,"
    )
    monkeypatch.setenv("LANCE_SINK__MEMTABLE__MAX_ROWS", "-1")
    assert [p[:2] for p in problems(path)] == [
        ("memtabel", "environment LANCE_SINK__MEMTABEL__MAX_ROWS"),
        ("memtable.max_rows", "environment LANCE_SINK__MEMTABLE__MAX_ROWS"),
    ]


def test_check_config_refuses_a_misspelled_environment_section(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    env = {"LANCE_SINK__MEMTABEL__MAX_ROWS": "5"}
    result = cli("check-config", str(path), env=env)
    assert result.returncode == 2, result.stdout
    assert "LANCE_SINK__MEMTABEL__MAX_ROWS" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("template", "found"),
    [
        ("{topic} dead!", "' ' '!'"),
        ("dlq/{topic}", "'/'"),
        ("{topic}.dlq\u00e9", "'\u00e9'"),
        ("{{topic}}", "'{' '}'"),
    ],
)
def test_dlq_topic_template_with_characters_kafka_refuses(
    tmp_path: Path, template: str, found: str
) -> None:
    """A template that cannot make a legal Kafka topic name is a configuration error naming
    the key and the file, not a partition held forever by a librdkafka error at run time."""
    path = write(tmp_path, MINIMAL + f"\n[dlq]\ntopic_template = {json.dumps(template)}\n")
    [(key, origin, reason)] = problems(path)
    assert (key, origin) == ("dlq.topic_template", f"file {path}")
    assert reason.endswith("beside the {topic} placeholder; found " + found), reason


@pytest.mark.parametrize(
    ("topics", "template", "why"),
    [
        (["events", "e" * 246], "{topic}.dlq", f"'{'e' * 246}.dlq': is 250 characters long"),
        (["events"], "{topic}" + "x" * 244, "is 250 characters long, more than Kafka's 249"),
        (["events"], ".", "'.': '.' is not a legal Kafka topic name"),
        (["events"], "..", "'..': '..' is not a legal Kafka topic name"),
    ],
)
def test_dlq_topic_template_must_make_a_legal_topic_of_every_topic(
    tmp_path: Path, topics: list[str], template: str, why: str
) -> None:
    text = MINIMAL.replace('topics = ["events"]', f"topics = {json.dumps(topics)}")
    path = write(tmp_path, text + f"\n[dlq]\ntopic_template = {json.dumps(template)}\n")
    [(key, origin, reason)] = problems(path)
    assert (key, origin) == ("dlq.topic_template", f"file {path}")
    assert why in reason, reason
    # Without a dead-letter topic the template names nothing: no error.
    settings = load_settings(path, ["dlq.enabled=false"])
    assert settings.dlq.topic_template == template
    # The longest legal name passes.
    ok = load_settings(path, ["dlq.topic_template={topic}", "kafka.topics=['e" + "e" * 248 + "']"])
    assert ok.dlq.topic_template == "{topic}"


def test_check_config_refuses_an_illegal_dlq_topic_template(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + '\n[dlq]\ntopic_template = "{topic} dead!"\n')
    result = cli("check-config", str(path))
    assert result.returncode == 2, result.stdout
    assert "dlq.topic_template" in result.stderr
    assert str(path) in result.stderr
    assert "Traceback" not in result.stderr


def test_the_consumer_reads_its_topics_metadata_every_10_s(tmp_path: Path) -> None:
    """A topic created after the start (or a partition added) is seen at the next metadata
    refresh: 10 s, not librdkafka's 300 s; `kafka.librdkafka` may still set it (not owned).
    tests/e2e/test_new_topics.py shows the effect on a broker."""
    from sink.consumer.conf import consumer_conf  # noqa: PLC0415 - the service is heavy to import

    settings = load_settings(write(tmp_path, MINIMAL))
    assert consumer_conf(settings)["topic.metadata.refresh.interval.ms"] == 10_000
    path = write(
        tmp_path, MINIMAL + '\n[kafka.librdkafka]\n"topic.metadata.refresh.interval.ms" = 60000\n'
    )
    assert consumer_conf(load_settings(path))["topic.metadata.refresh.interval.ms"] == 60_000


def descriptor_set(tmp_path: Path) -> Path:
    """shop.desc: a FileDescriptorSet of shop.proto with shop.v1.Order {string id}."""
    from google.protobuf import descriptor_pb2  # noqa: PLC0415 - only these tests use it

    files = descriptor_pb2.FileDescriptorSet()
    fd = files.file.add(name="shop.proto", package="shop.v1", syntax="proto3")
    order = fd.message_type.add(name="Order")
    order.field.add(name="id", number=1, type=9, label=1)  # TYPE_STRING, LABEL_OPTIONAL
    path = tmp_path / "shop.desc"
    path.write_bytes(files.SerializeToString())
    return path


def protobuf_config(tmp_path: Path, descriptor: Path | str, message: str) -> Path:
    return write(
        tmp_path,
        MINIMAL
        + f'\n[source]\nformat = "protobuf"\n[source.protobuf]\ndescriptor_set = "{descriptor}"\n'
        f'message = "{message}"\n',
    )


def test_protobuf_descriptor_set_is_read_when_the_settings_load(tmp_path: Path) -> None:
    """The descriptor set and its message are checked as the start would use them, so
    `check-config` reports a missing file, a file that is no descriptor set and a message the
    set lacks, each at its key and origin (the start died on a FileNotFoundError)."""
    good = descriptor_set(tmp_path)
    settings = load_settings(protobuf_config(tmp_path, good, "shop.v1.Order"))
    assert settings.source.protobuf is not None
    missing = tmp_path / "nope.desc"
    path = protobuf_config(tmp_path, missing, "shop.v1.Order")
    assert problems(path) == [
        (
            "source.protobuf.descriptor_set",
            f"file {path}",
            f"cannot read {missing}: No such file or directory",
        )
    ]
    [(key, origin, reason)] = problems(protobuf_config(tmp_path, path, "shop.v1.Order"))
    assert (key, origin) == ("source.protobuf.descriptor_set", f"file {path}")
    assert reason.startswith(f"{path} is not a FileDescriptorSet"), reason
    [(key, origin, reason)] = problems(protobuf_config(tmp_path, good, "shop.v1.Nope"))
    assert (key, origin) == ("source.protobuf.message", f"file {path}")
    assert reason == f"{good} has no message 'shop.v1.Nope' (its messages: shop.v1.Order)"


@pytest.mark.parametrize("command", ["check-config", "run"])
def test_missing_descriptor_set_exits_2(tmp_path: Path, command: str) -> None:
    path = protobuf_config(tmp_path, "/nonexistent/nope.desc", "shop.v1.Order")
    result = cli(command, *(["--config"] if command == "run" else []), str(path))
    assert result.returncode == 2, result.stderr
    assert (
        f"source.protobuf.descriptor_set (file {path}): cannot read /nonexistent/nope.desc: "
        "No such file or directory" in result.stderr
    )
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("fmt", ["avro", "protobuf", "json_schema", "raw"])
def test_base64_f32_vectors_are_for_the_json_format_only(tmp_path: Path, fmt: str) -> None:
    """`table.vector.encoding = "base64_f32"` describes a JSON value; check-config passed it
    with every other format (the decoder refused it only at start)."""
    text = MINIMAL + '\n[table.vector]\ncolumn = "vec"\ndim = 4\nencoding = "base64_f32"\n'
    text += f'[source]\nformat = "{fmt}"\n'
    if fmt == "raw":
        text += 'columns = { body = "@value" }\n'
    else:
        text += '[source.schema_registry]\nurl = "mock://r"\n'
    path = write(tmp_path, text)
    [(key, origin, reason)] = problems(path)
    assert (key, origin) == ("table.vector.encoding", f"file {path}")
    assert reason.startswith(f"'base64_f32' is for source.format 'json' only (it is '{fmt}'")
    assert load_settings(path, ["source.format=json", "source.columns={}"]).table.vector


def test_check_config_refuses_base64_f32_vectors_with_avro(tmp_path: Path) -> None:
    text = MINIMAL + '\n[table.vector]\ncolumn = "vec"\ndim = 4\nencoding = "base64_f32"\n'
    text += '[source]\nformat = "avro"\n[source.schema_registry]\nurl = "http://r:8081"\n'
    path = write(tmp_path, text)
    result = cli("check-config", str(path))
    assert result.returncode == 2, result.stdout
    assert f"table.vector.encoding (file {path}): 'base64_f32' is for source.format" in (
        result.stderr
    )


REGISTRY = (
    MINIMAL + '\n[source]\nformat = "avro"\n[source.schema_registry]\nurl = "http://r:8081"\n'
)
PASSWORD_VAR = "LANCE_SINK__SOURCE__SCHEMA_REGISTRY__BASIC_AUTH_PASSWORD"


def test_registry_auth_conflict_names_where_each_key_comes_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Basic auth (the password from the environment) and a bearer token in the file: the
    problem is the file's bearer_token, with where each basic-auth key comes from (it was
    blamed on 'environment LANCE_SINK__SOURCE__SCHEMA_REGISTRY', a variable nobody set)."""
    monkeypatch.setenv(PASSWORD_VAR, "pw")
    path = write(tmp_path, REGISTRY + 'basic_auth_username = "u"\nbearer_token = "s3cr3t-t0ken"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    [problem] = info.value.problems
    assert (problem.key, problem.origin) == ("source.schema_registry.bearer_token", f"file {path}")
    assert problem.reason == "use basic auth or a bearer token, not both"
    assert problem.related == (
        ("source.schema_registry.basic_auth_username", f"file {path}"),
        ("source.schema_registry.basic_auth_password", f"environment {PASSWORD_VAR}"),
    )
    assert str(problem) == (
        f"source.schema_registry.bearer_token (file {path}): use basic auth or a bearer "
        f"token, not both; with source.schema_registry.basic_auth_username (file {path}), "
        f"source.schema_registry.basic_auth_password (environment {PASSWORD_VAR})"
    )
    assert "s3cr3t-t0ken" not in str(info.value)


def test_registry_basic_auth_halves_name_the_missing_one(tmp_path: Path) -> None:
    path = write(tmp_path, REGISTRY + 'basic_auth_username = "u"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    [problem] = info.value.problems
    assert (problem.key, problem.origin) == (
        "source.schema_registry.basic_auth_password",
        f"not set in file {path}",
    )
    assert problem.related == (("source.schema_registry.basic_auth_username", f"file {path}"),)


def test_a_section_filled_from_file_and_environment_names_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PASSWORD_VAR, "pw")
    path = write(tmp_path, REGISTRY + 'basic_auth_username = "u"\n')
    problem = problem_at("source.schema_registry", "why", path)
    assert problem.origin == f"file {path} and environment {PASSWORD_VAR}"
    problem = problem_at("source.schema_registry", "why", write(tmp_path, MINIMAL, "other.toml"))
    assert problem.origin == f"environment {PASSWORD_VAR}"


def test_registry_format_without_a_registry_names_the_missing_section(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + '\n[source]\nformat = "avro"\n')
    assert problems(path) == [
        (
            "source.schema_registry",
            f"not set in file {path}",
            "format 'avro' needs a [source.schema_registry] section",
        )
    ]
