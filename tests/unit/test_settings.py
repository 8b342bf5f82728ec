"""The settings model and loader: examples, precedence, secrets, and every kind of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from config import ConfigError, load_settings, redacted
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


@pytest.mark.parametrize("name", ["quickstart.toml", "production.toml"])
def test_examples_load(name: str) -> None:
    settings = load_settings(EXAMPLES / name)
    assert settings.kafka.topics
    assert settings.table.columns


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
    [("gs://bucket/t", "unsupported URI scheme 'gs'"), ("s3:///t.lance", "needs a bucket")],
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


# --- the CLI -------------------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sink.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
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
