"""The package's layering, checked on the real import graph (grimp, import-linter's engine).

Data flows recall -> probe -> signature -> decision -> plan -> denoise -> store; each layer below may import only
what the contract names. Imports under ``if TYPE_CHECKING:`` are annotations, not dependencies, and are left out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grimp
import pytest

import carnator


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("carnator", "carnator_lab", exclude_type_checking_imports=True)


def _imports_of(graph, package: str) -> set[str]:
    """Modules outside ``package`` that ``package`` (or any of its modules) imports directly."""
    members = {package} | (graph.find_descendants(package) if graph.find_children(package) else set())
    out: set[str] = set()
    for m in members:
        out |= graph.find_modules_directly_imported_by(m)
    return {m for m in out if m not in members}


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(m for m in graph.modules if m.startswith("carnator.") or m == "carnator"):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_library_never_imports_the_lab(graph):
    assert not graph.chain_exists(importer="carnator", imported="carnator_lab", as_packages=True)


# What only a test or a benchmark does: drive a test framework, or set up a database cluster of its own.
TEST_FRAMEWORKS = {"pytest", "_pytest", "schemathesis", "hypothesis", "playwright"}
CLUSTER_PROGRAMS = ("initdb", "pg_ctl")


def _harness_traces(src: Path) -> list[str]:
    """Where a package under ``src`` imports a test framework or names a cluster program."""
    found = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found += [f"{path.relative_to(src)} imports {n}" for n in names if n.split(".")[0] in TEST_FRAMEWORKS]
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [f"{path.relative_to(src)} names {p!r}" for p in CLUSTER_PROGRAMS if p in node.value]
    return found


def test_the_library_holds_no_test_harness():
    """The harnesses the tests and benchmarks share (a throwaway PostgreSQL cluster, ``carnator serve`` in a child
    process) live in ``tests/harness/``, not in the installed package: no module of ``carnator`` imports a test
    framework or starts a PostgreSQL cluster (the library connects to one it is given the URL of)."""
    assert _harness_traces(Path(carnator.__file__).resolve().parent) == []
    harness = Path(__file__).resolve().parent / "harness"
    assert {"postgres.py", "server.py"} <= {p.name for p in harness.glob("*.py")}
    assert _harness_traces(harness)  # what the check looks for is there


def test_the_harness_check_sees_a_harness(tmp_path):
    (tmp_path / "fixtures.py").write_text("import pytest\nimport subprocess\nsubprocess.run(['initdb', '-D', 'x'])\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "db.py").write_text("from _pytest.tmpdir import TempPathFactory\nCMD = 'pg_ctl -D data start'\n")
    assert _harness_traces(tmp_path) == ["fixtures.py imports pytest", "fixtures.py names 'initdb'",
                                         "sub/db.py imports _pytest.tmpdir", "sub/db.py names 'pg_ctl'"]


# The project's work items (an issue number, a lever, a numbered work session) belong to the lab notebook
# (lab/notebook/HISTORY.md); the library's text says what a thing is and what measured it.
WORK_ITEMS = re.compile(r"\bissue #?\d|\blevers?\b|\bsession[ -]?\d", re.IGNORECASE)


def test_the_library_names_no_work_items():
    src = Path(carnator.__file__).resolve().parent
    found = [f"{path.relative_to(src)}:{i}: {line.strip()[:80]}"
             for path in sorted(p for p in src.rglob("*") if p.suffix in {".py", ".json", ".html", ".md", ".txt"})
             for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if WORK_ITEMS.search(line)]
    assert found == []
    assert [bool(WORK_ITEMS.search(t)) for t in ("lever 2 (issue 26)", "the session-12 rule", "an AttentionSession",
                                                 "a session advisory lock", "leverage")] == [True, True, False, False, False]


def test_the_embedded_models_judge_is_the_librarys_and_the_lab_reads_clips_with_it(graph):
    """The shapes judge ships with the library: its clip reader (``carnator.embedded.world``) needs nothing else of
    carnator, the judge only the judges' protocol; the lab's world imports that reader and keeps no copy of it."""
    world = "carnator.embedded.world"
    assert {"carnator.embedded.judge", f"{world}.judge", f"{world}.captions", f"{world}.scene", f"{world}.render"} <= graph.modules
    assert {m for m in _imports_of(graph, world) if m.split(".")[0] == "carnator"} == set()
    assert {m for m in _imports_of(graph, "carnator.embedded.judge") if m.split(".")[0] == "carnator"} == {
        "carnator.judges", f"{world}.judge"}
    for module, name in (("carnator_lab.world", "judge"), ("carnator_lab.world.captions", "captions"),
                         ("carnator_lab.world.scene", "scene"), ("carnator_lab.world.render", "render")):
        assert graph.direct_import_exists(importer=module, imported=f"{world}.{name}"), module
    assert not {"carnator_lab.judge", "carnator_lab.world.judge"} & graph.modules


def test_no_import_cycles(graph):
    assert _cycles(graph) == []


def test_cycle_finder_sees_a_cycle():
    g = grimp.ImportGraph()
    for a, b in [("carnator.a", "carnator.b"), ("carnator.b", "carnator.c"), ("carnator.c", "carnator.a"), ("carnator.c", "carnator.d")]:
        g.add_import(importer=a, imported=b)
    assert _cycles(g) == [["carnator.a", "carnator.b", "carnator.c"]]


@pytest.mark.parametrize(
    "package, forbidden",
    [
        # A policy only decides and returns plain data: no model, no store, no denoising.
        ("carnator.policies", ["carnator.backbones", "carnator.cache.bank", "carnator.denoise", "carnator.engine", "carnator.stages", "carnator.service"]),
        # The store only stores.
        ("carnator.cache", ["carnator.backbones", "carnator.engine", "carnator.policies", "carnator.denoise", "carnator.reuse", "carnator.service"]),
        # The compatibility math and the signature know no model and no store.
        ("carnator.reuse", ["carnator.backbones", "carnator.cache", "carnator.engine", "carnator.policies", "carnator.denoise", "carnator.calibrate"]),
        # Calibration's maths selects and certifies from labelled pairs: no model, no store, no engine; the run that
        # generates and judges the pairs (carnator.calibrate.run) is the only part that drives an engine.
        ("carnator.calibrate.certify", ["carnator.backbones", "carnator.cache", "carnator.engine", "carnator.policies", "carnator.denoise",
                                        "carnator.stages", "carnator.judges", "carnator.calibrate.run"]),
        ("carnator.signature", ["carnator.backbones", "carnator.cache", "carnator.engine", "carnator.policies", "carnator.reuse"]),
        ("carnator.judges", ["carnator.backbones", "carnator.cache", "carnator.engine", "carnator.policies"]),
        # The denoiser executes plans; it never decides.
        ("carnator.denoise", ["carnator.policies", "carnator.cache", "carnator.engine", "carnator.stages"]),
        # The recall embedder maps prompts to vectors: it knows no video model, no store and no request.
        ("carnator.recall", ["carnator.backbones", "carnator.cache", "carnator.engine", "carnator.policies", "carnator.stages", "carnator.service"]),
        # A stage runs one step of one request over its RequestState: it never reaches back into the engine that
        # sequences the stages, nor up into the service or the command line.
        ("carnator.stages", ["carnator.engine", "carnator.service", "carnator.cli", "carnator.bench", "carnator.calibrate.run"]),
        # The service queues, routes and reports: it reaches models only through the engine.
        ("carnator.service", ["carnator.backbones", "carnator.denoise", "carnator.stages", "carnator.attention"]),
    ],
)
def test_layer_contract(graph, package, forbidden):
    bad = sorted(m for m in _imports_of(graph, package) if any(m == f or m.startswith(f + ".") for f in forbidden))
    assert bad == [], f"{package} imports {bad}"


def test_the_engine_runs_the_named_stages(graph):
    """exact -> recall -> probe -> decide -> plan -> denoise -> store: each stage its own module, which the engine
    imports (and the stages' request state is the one object they share)."""
    for stage in ("exact", "recall", "probe", "decide", "plan", "store", "state"):
        assert f"carnator.stages.{stage}" in graph.modules, stage
    assert graph.direct_import_exists(importer="carnator.engine", imported="carnator.stages")
    for stage in ("exact", "decide", "plan", "store"):
        assert graph.direct_import_exists(importer="carnator.stages", imported=f"carnator.stages.{stage}"), stage
