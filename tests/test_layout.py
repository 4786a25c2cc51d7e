"""The package's shape holds: one owner per table, a small façade, libraries behind one module."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import memory

ROOT = Path(__file__).resolve().parents[1]
MEMORY = ROOT / "memory"
MIGRATIONS = MEMORY / "storage" / "migrations.py"
POSTGRES_SCHEMA = MEMORY / "storage" / "postgres_schema.py"  # the same tables on PostgreSQL
SHARED_SCHEMA = MEMORY / "storage" / "schema.py"  # the tables both backends have, declared once
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
    schema = MIGRATIONS.read_text() + POSTGRES_SCHEMA.read_text() + SHARED_SCHEMA.read_text()
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
            if statement.search(text) and path != str(SHARED_SCHEMA.relative_to(ROOT))
            and (path not in SCHEMAS or table == "migrations")
        ]
    assert len(owners) >= 15
    assert sorted(owners.pop("migrations")) == sorted(SCHEMAS)
    assert {table: len(paths) for table, paths in owners.items()} == dict.fromkeys(owners, 1), owners
    assert all(paths[0].startswith("memory/storage/") for paths in owners.values()), owners


def test_proxy_and_scripts_import_memory_only_through_its_facade() -> None:
    deep = re.compile(r"^\s*(?:from|import) memory\.\w", re.MULTILINE)
    offenders = [path for path, text in sources("proxy", "scripts").items() if deep.search(text)]
    assert offenders == []


def typed_exports() -> tuple[list[str], list[str], list[str]]:
    """What memory/__init__.py's TYPE_CHECKING blocks give mypy: the names imported, those
    imported under a new name (`X as Y`), and the names added to __all__ (mypy exports an
    import that renames only when __all__ names it)."""
    tree = ast.parse((MEMORY / "__init__.py").read_text())
    imported, renamed, added = [], [], []
    for block in (node for node in tree.body if isinstance(node, ast.If)):
        for node in block.body:
            if isinstance(node, ast.ImportFrom):
                imported += [alias.asname or alias.name for alias in node.names]
                renamed += [alias.asname for alias in node.names
                            if alias.asname not in (None, alias.name)]
            elif isinstance(node, ast.AugAssign) and isinstance(node.value, ast.List):
                added += [ast.literal_eval(item) for item in node.value.elts]
    return imported, renamed, added


def test_the_facade_exports_exactly_what_it_lists() -> None:
    for name in memory.__all__:
        assert getattr(memory, name) is not None, name
    assert sorted(memory._EXPORTS) == sorted(memory.__all__)
    # What mypy reads (the TYPE_CHECKING blocks) exports the same names as the run-time table.
    imported, renamed, added = typed_exports()
    assert sorted(imported) == sorted(memory.__all__)
    assert renamed and sorted(renamed) == sorted(added)
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
        # Traces: the API in memory's and the proxy's tracing modules; the SDK is configured
        # in one place (proxy/http/telemetry.py).
        ("opentelemetry", {"memory/tracing.py", "proxy/http/tracing.py", "proxy/http/telemetry.py"}),
        # The management API's, the MCP tools' and the import records' shapes are declared
        # with it; bodies.py makes validation and schemas of them (docs/dependencies.md).
        ("pydantic", {"proxy/management/bodies.py", "proxy/management/answers.py",
                      "memory/admin/record_checks.py", "proxy/mcp/schemas.py"}),
        # vectors.py checks Chroma's own SQLite file, never ours.
        ("sqlite3", {"memory/storage/database.py", "memory/storage/migrations.py",
                     "memory/storage/spool.py",
                     "memory/storage/snapshot.py", "memory/storage/bulk_copy.py",
                     "memory/index/vectors.py"}),
    ):
        importing = re.compile(rf"^\s*(?:import|from) {library}\b", re.MULTILINE)
        assert {path for path, text in code.items() if importing.search(text)} == allowed


# proxy/'s packages, each importing only from those before it (docs/architecture.md, "Layers").
PROXY_LAYERS = (
    "http", "upstream", "access", "state", "formats", "flow", "management", "mcp", "app", "cli",
    "__main__",
)
MAX_MODULE_LINES = 500


def import_graph() -> dict[str, set[str]]:
    """{module: the project modules it imports}, over config, memory and proxy, counting
    imports under TYPE_CHECKING and inside functions."""
    paths = {}
    for folder in ("config", "memory", "proxy"):
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            paths[".".join(parts)] = path

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in paths else known(base))
        graph[module] = {name for name in found if name is not None and name != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_back() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_check_sees_every_kind_of_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    # A TYPE_CHECKING import and one inside a function are edges of the graph.
    edges = import_graph()
    assert "proxy.flow.call" in edges["proxy.flow.memory_tool.loop"]  # under TYPE_CHECKING
    assert "proxy.app" in edges["proxy.cli.main"]  # inside serve()


def test_proxy_packages_import_only_the_layers_before_them() -> None:
    def layer(module: str) -> int:
        return PROXY_LAYERS.index(module.split(".")[1])

    offenders = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if module.startswith("proxy.") and module != "proxy"
        for target in targets
        if target.startswith("proxy.") and layer(target) > layer(module)
    ]
    assert offenders == []
    assert {path.name for path in (ROOT / "proxy").iterdir() if path.suffix == ".py"} == {
        "__init__.py", "__main__.py", "app.py", "state.py",
    }


def test_http_imports_nothing_else_of_proxy() -> None:
    graph = import_graph()
    assert all(
        target.startswith("proxy.http")
        for module, targets in graph.items() if module.startswith("proxy.http")
        for target in targets if target.startswith("proxy")
    )


def test_no_module_is_over_the_size_limit() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for folder in ("config", "memory", "proxy")
        for path in (ROOT / folder).rglob("*.py")
    }
    assert {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_code_cites_the_project_s_own_docs() -> None:
    # The external contract is not in the repository; docs/architecture.md is.
    code = sources("config", "memory", "proxy", "scripts", "tests")
    assert [path for path, text in code.items() if "DESIGN" + ".md" in text] == []
