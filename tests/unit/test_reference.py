"""The configuration reference in README.md is generated from the settings model."""

from __future__ import annotations

from pathlib import Path

from config.reference import END, START, reference, splice

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_reference_matches_the_settings_model() -> None:
    text = README.read_text()
    assert START in text
    assert END in text
    assert splice(text, reference()) == text, "README.md is stale: run `make docs`"


def test_reference_lists_every_section_and_key() -> None:
    body = reference()
    for key in (
        "kafka.bootstrap_servers",
        "wal.max_wal_flush_interval_ms",
        "table.vector.dim",
        "backpressure.process_budget_bytes",
        "query.auth_token",
        "shutdown.drain_deadline_s",
    ):
        assert f"`{key}`" in body
