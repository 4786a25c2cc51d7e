"""The package's shape holds: one owner per table, a small façade, libraries behind one module."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import memory

ROOT = Path(__file__).resolve().parents[1]
MEMORY = ROOT / "memory"
MIGRATIONS = MEMORY / "storage" / "migrations.py"
POSTGRES_SCHEMA = MEMORY / "storage" / "postgres_schema.py"  # the same tables on PostgreSQL
SCHEMAS = {str(path.relative_to(ROOT)) for path in (MIGRATIONS, POSTGRES_SCHEMA)}


def sources(*folders: str) -> dict[str, str]:
    """Text of every .py file under these folders, keyed by its path from the root."""
    return {
        str(path.relative_to(ROOT)): path.read_text()
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
    }


def tables() -> list[str]:
    """Every table and virtual table the migrations of both backends create, and the
    migrations table."""
    schema = MIGRATIONS.read_text() + POSTGRES_SCHEMA.read_text()
    found = re.findall(r"CREATE (?:VIRTUAL )?TABLE (?:IF NOT EXISTS )?(\w+)", schema)
    return sorted(set(found))


def test_every_table_has_its_sql_in_exactly_one_module() -> None:
    # The migrations hold every table's schema, and own the table that records them (each
    # backend's migrations record themselves).
    owners = {}
    for table in tables():
        statement = re.compile(rf"\b(?:FROM|INTO|UPDATE|JOIN|TABLE)\s+{table}\b|\b{table}\s+MATCH\b")
        owners[table] = [
            path for path, text in sources("memory", "proxy", "config").items()
            if statement.search(text) and (path not in SCHEMAS or table == "migrations")
        ]
    assert len(owners) >= 15
    assert sorted(owners.pop("migrations")) == sorted(SCHEMAS)
    assert {table: len(paths) for table, paths in owners.items()} == dict.fromkeys(owners, 1), owners
    assert all(paths[0].startswith("memory/storage/") for paths in owners.values()), owners


def test_proxy_and_scripts_import_memory_only_through_its_facade() -> None:
    deep = re.compile(r"^\s*(?:from|import) memory\.\w", re.MULTILINE)
    offenders = [path for path, text in sources("proxy", "scripts").items() if deep.search(text)]
    assert offenders == []


def test_the_facade_exports_exactly_what_it_lists() -> None:
    for name in memory.__all__:
        assert getattr(memory, name) is not None, name
    assert sorted(memory._EXPORTS) == sorted(memory.__all__)
    # A name it does not list is an AttributeError, and a subpackage still imports.
    try:
        memory.Store  # noqa: B018
    except AttributeError as exc:
        assert "Store" in str(exc)
    else:
        raise AssertionError("memory.Store should not exist")


def test_a_constant_from_the_facade_does_not_load_the_engine() -> None:
    # The CLI imports CATEGORIES; it must not pay for chromadb and the tokenizers.
    probe = "import sys, memory; memory.CATEGORIES; print('chromadb' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            cwd=ROOT, timeout=60, check=True)
    assert result.stdout.strip() == "False"


def test_each_third_party_store_library_lives_behind_one_module() -> None:
    code = sources("memory", "proxy", "config")
    for library, allowed in (
        ("aiosqlite", {"memory/storage/database.py"}),
        ("asyncpg", {"memory/storage/postgres.py", "memory/storage/postgres_schema.py"}),
        ("chromadb", {"memory/index/vectors.py"}),
        # vectors.py checks Chroma's own SQLite file, never ours.
        ("sqlite3", {"memory/storage/database.py", "memory/storage/migrations.py",
                     "memory/storage/spool.py",
                     "memory/storage/snapshot.py", "memory/storage/bulk_copy.py",
                     "memory/index/vectors.py"}),
    ):
        importing = re.compile(rf"^\s*(?:import|from) {library}\b", re.MULTILINE)
        assert {path for path, text in code.items() if importing.search(text)} == allowed
