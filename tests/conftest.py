"""Shared fixtures: a real PostgreSQL for the shared cache store's tests.

``$CARNATOR_TEST_POSTGRES_URL`` (``.ci/run`` starts a cluster and sets it) or, when unset, a throwaway cluster this
test run starts itself (``harness.postgres``: initdb in a temp dir, 127.0.0.1, a free port). Under ``CI=true`` a missing PostgreSQL fails the
tests that need it; elsewhere they are skipped with the reason.
"""

from __future__ import annotations

import os
import uuid

import pytest

POSTGRES_ENV = "CARNATOR_TEST_POSTGRES_URL"


@pytest.fixture(scope="session")
def postgres_url():
    url = os.environ.get(POSTGRES_ENV)
    if url:
        yield url
        return
    from harness.postgres import LocalPostgres, PostgresUnavailable

    try:
        import psycopg  # noqa: F401

        pg = LocalPostgres().start()
    except (ImportError, PostgresUnavailable) as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"PostgreSQL is required in CI: {exc}")
        pytest.skip(f"no PostgreSQL here ({exc}); set {POSTGRES_ENV} or install postgresql")
    try:
        yield pg.url
    finally:
        pg.stop()


@pytest.fixture
def pg_schema_url(postgres_url):
    """A store URL of a fresh schema (each test its own tables)."""
    sep = "&" if "?" in postgres_url else "?"
    return f"{postgres_url}{sep}schema=t_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def private_postgres():
    """A PostgreSQL cluster of this test's own, which it may stop and start again (``pause()``, ``resume()``: an
    outage or a restart)."""
    from harness.postgres import LocalPostgres, PostgresUnavailable

    try:
        pg = LocalPostgres().start()
    except PostgresUnavailable as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"PostgreSQL is required in CI: {exc}")
        pytest.skip(f"no PostgreSQL here ({exc})")
    try:
        yield pg
    finally:
        pg.stop()


def load_pg_dump(url: str, text: str) -> None:
    """Create the schema of ``url`` (a ``pg_schema_url``) and run a SQL dump in it, statement by statement (the stores
    written by an earlier version, tests/stores/)."""
    import psycopg

    from carnator.cache.shared import parse_store_url

    conninfo, schema = parse_store_url(url)
    with psycopg.connect(conninfo, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {schema}")
        c.execute(f"SET search_path TO {schema}")
        for stmt in text.split(";\n"):
            if stmt.strip():
                c.execute(stmt)
