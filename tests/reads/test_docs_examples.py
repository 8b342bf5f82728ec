"""Every curl example of docs/reads.md's HTTP section, sent as written (curl's form
Content-Type, `[0.1, ...]` expanded to a vector) to a table of the quickstart's schema."""

from __future__ import annotations

import datetime as dt
import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from config.settings import QuerySettings, TableSettings
from engine.reader import Reader
from engine.schema import TableSpec
from engine.table import BaseTable
from sink.http import create_query_app

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
CURL = "application/x-www-form-urlencoded"  # what `curl -d` sends


def examples() -> list[str]:
    text = (ROOT / "docs" / "reads.md").read_text()
    section = text[text.index("## The HTTP API") :]
    block = section[section.index("```bash") + len("```bash") : section.index("```\n", 8)]
    return [line for line in block.splitlines() if line.startswith("curl ")]


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    raw = tomllib.loads((ROOT / "config" / "examples" / "quickstart.toml").read_text())["table"]
    spec = TableSpec.from_settings(
        TableSettings.model_validate({**raw, "uri": str(tmp_path / "reviews.lance")})
    )
    table = BaseTable(spec)
    table.open()
    rng = np.random.default_rng(7)
    n = 200
    assert spec.vector is not None
    vectors = rng.standard_normal((n, spec.vector.dim)).astype(np.float32)
    rows = {
        "id": [f"r-{i}" for i in range(n)],
        "title": [f"disk full on node {i}" if i % 3 == 0 else f"review {i}" for i in range(n)],
        "text": ["the disk was full" if i % 2 else "fine product" for i in range(n)],
        "category": ["books" if i % 4 == 0 else "tools" for i in range(n)],
        "rating": [i % 5 + 1 for i in range(n)],
        "published_at": [
            dt.datetime(2025, 12, 1, tzinfo=dt.UTC) + dt.timedelta(days=i) for i in range(n)
        ],
        spec.vector.name: pa.FixedSizeListArray.from_arrays(
            pa.array(vectors.reshape(-1)), spec.vector.dim
        ),
        "_topic": ["reviews"] * n,
        "_partition": [0] * n,
        "_offset": list(range(n)),
    }
    schema = spec.table_schema
    batch = pa.table({f.name: pa.array(rows[f.name], f.type) for f in schema}, schema=schema)

    lance.write_dataset(batch, spec.uri, mode="append")
    reader = Reader(spec, table, list)
    settings = QuerySettings(auth_token=SecretStr("s3cret"))
    with TestClient(create_query_app(reader, settings)) as c:
        yield c
    reader.close()


def test_the_docs_have_examples_of_every_kind() -> None:
    found = examples()
    assert len(found) >= 6
    assert any("/v1/lookup" in line for line in found)
    assert any('"vector"' in line and '"text"' in line for line in found)


@pytest.mark.parametrize("line", examples())
def test_every_documented_example_answers(client: TestClient, line: str) -> None:
    args = shlex.split(line)
    url = next(a for a in args if a.startswith("localhost:"))
    path = url[url.index("/") :]
    body = args[args.index("-d") + 1]
    headers = {"Content-Type": CURL}
    if "-H" in args:
        name, _, value = args[args.index("-H") + 1].partition(": ")
        headers[name] = value
    else:
        headers["Authorization"] = "Bearer s3cret"  # the server of this test has a token
    vector = json.dumps([0.1] * 384)
    body = re.sub(r"\[0\.1, \.\.\.\]", vector, body)
    r = client.post(path, content=body.encode(), headers=headers)
    assert r.status_code == 200, (line, r.text)
    assert r.json()["count"] > 0, line
