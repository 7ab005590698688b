"""The cache store's tables, written once for both databases (SQLAlchemy Core; compiled to each one's DDL and run on
the store's own connection), and the numbered steps that bring a store's tables to the current version in place.

A store records its version in its ``meta`` table (``schema_version``); a writable opener takes every step in order,
each a no-op where its change is already there, and refuses tables of a newer version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import CreateIndex, CreateTable

from ..errors import CacheError

_SEQ = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite: INTEGER PRIMARY KEY AUTOINCREMENT (the rowid)
_COUNT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

TABLES = sa.MetaData()
sa.Table("meta", TABLES, sa.Column("key", sa.Text, primary_key=True), sa.Column("value", sa.Text, nullable=False))
_entries = sa.Table(
    "entries", TABLES,
    sa.Column("seq", _SEQ, primary_key=True, autoincrement=True),
    sa.Column("id", sa.Text, nullable=False, unique=True),
    sa.Column("tenant", sa.Text, nullable=False),
    sa.Column("compat_key", sa.Text, nullable=False),
    sa.Column("exact_key", sa.Text),
    sa.Column("prompt", sa.Text, nullable=False),
    sa.Column("negative_prompt", sa.Text),
    sa.Column("seed", sa.Text),
    sa.Column("created", sa.Double, nullable=False),
    sa.Column("last_used", sa.Double, nullable=False),
    sa.Column("use_count", _COUNT, nullable=False, server_default="0"),
    sa.Column("steps_saved", sa.Double, nullable=False, server_default="0"),
    sa.Column("nbytes", _COUNT, nullable=False),
    sa.Column("embedding", sa.LargeBinary, nullable=False),
    sa.Column("extra", sa.Text, nullable=False, server_default="{}"),
    sa.Column("layout", sa.Text, nullable=False),
    sa.Column("content_key", sa.Text),
    sqlite_autoincrement=True,
)
sa.Index("entries_scope", _entries.c.tenant, _entries.c.compat_key, _entries.c.seq)
sa.Index("entries_exact", _entries.c.tenant, _entries.c.exact_key)
_content = sa.Index("entries_content", _entries.c.tenant, _entries.c.compat_key, _entries.c.content_key, _entries.c.seq)
sa.Table("scopes", TABLES, sa.Column("tenant", sa.Text, primary_key=True), sa.Column("compat_key", sa.Text, primary_key=True),
         sa.Column("dim", sa.Integer, nullable=False))
_removals = sa.Table("removals", TABLES, sa.Column("seq", _SEQ, primary_key=True, autoincrement=True),
                     sa.Column("id", sa.Text, nullable=False), sa.Column("tenant", sa.Text, nullable=False),
                     sa.Column("compat_key", sa.Text, nullable=False), sqlite_autoincrement=True)
sa.Index("removals_scope", _removals.c.tenant, _removals.c.compat_key, _removals.c.seq)
sa.Table("leases", TABLES, sa.Column("tenant", sa.Text, primary_key=True), sa.Column("exact_key", sa.Text, primary_key=True),
         sa.Column("holder", sa.Text, nullable=False), sa.Column("host", sa.Text, nullable=False),
         sa.Column("pid", sa.Integer, nullable=False), sa.Column("expires", sa.Double, nullable=False))

_DIALECTS = {"sqlite": sqlite.dialect(), "postgresql": postgresql.dialect()}

#: ``run(sql)``: executes one statement on the store's connection, inside its schema transaction; returns rows.
Run = Callable[[str], Any]


def _ddl(element: Any, dialect: str) -> str:
    return str(element.compile(dialect=_DIALECTS[dialect])).strip()


def _tables(run: Run, dialect: str) -> None:
    """1: the tables and their indexes (IF NOT EXISTS: a store made before versions were recorded has them)."""
    for table in TABLES.sorted_tables:
        run(_ddl(CreateTable(table, if_not_exists=True), dialect))
        for index in sorted(table.indexes, key=lambda i: str(i.name)):
            if index is not _content:
                run(_ddl(CreateIndex(index, if_not_exists=True), dialect))


def _content_key(run: Run, dialect: str) -> None:
    """2: entries gained ``content_key`` (recall by content) after format 2's release, with its index."""
    if dialect == "postgresql":
        run("ALTER TABLE entries ADD COLUMN IF NOT EXISTS content_key TEXT")
    elif not any(row[1] == "content_key" for row in run("PRAGMA table_info(entries)")):
        run("ALTER TABLE entries ADD COLUMN content_key TEXT")
    run(_ddl(CreateIndex(_content, if_not_exists=True), dialect))


MIGRATIONS: tuple[Callable[[Run, str], None], ...] = (_tables, _content_key)
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(run: Run, dialect: str, found: str | None) -> None:
    """Take every step in order and record :data:`SCHEMA_VERSION`, inside the caller's transaction. Each step is a
    no-op where its change is already there, so a store whose version is not recorded (made before versions were),
    or whose tables lost a change behind its back, is brought up to date all the same. A store of a newer version
    (``found``, its recorded ``schema_version``) is refused: this carnator does not know its tables."""
    if found is not None and int(found) > SCHEMA_VERSION:
        raise CacheError(f"the cache's tables are of schema version {found}, written by a newer carnator (this one "
                         f"knows {SCHEMA_VERSION})")
    for step in MIGRATIONS:
        step(run, dialect)
    run(f"INSERT INTO meta (key, value) VALUES ('schema_version', '{SCHEMA_VERSION}') "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value")
