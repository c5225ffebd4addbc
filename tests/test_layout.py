"""The house's shape, read from the source with `ast` (nothing imported): no import cycle, each module imports
only from its own layer or below, no crowded folder, no long module, and every `mismatch_probe/...` path the
docs name exists. ARCHITECTURE.md draws the layers this file enforces."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mismatch_probe"
P = "mismatch_probe"

MAX_FLAT_MODULES = 15  # .py files directly in one folder, __init__.py counted
MAX_LINES = 400
MAX_CATALOGUE_LINES = 300  # report/keys/*: each under this

LEAVES = ("errors", "schema", "vocab", "jsonfile", "progress", "help_flags", "rundir", "model", "quant")
# What gate and compare may read: metrics.json and its vocabulary, never the accumulators.
METRICS_READERS_MAY_IMPORT = (
    "report.keys",
    "report.metrics_file",
    "report.numbers",
    "report.verdict.bands",
    "report.steps.drift",
    "frames.bootstrap",
    "doctor",
    "gate",
    "compare",
    *LEAVES,
)

# (layer, module prefixes), lowest first. A module belongs to the layer of its longest matching prefix and
# imports only from its own layer or any below it, unless the layer names what it may import (ONLY).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("leaves", LEAVES),
    ("engines", ("engines",)),
    ("frames", ("frames",)),
    ("report.keys", ("report.keys", "report.numbers", "report.metrics_file")),
    # doctor reads frames and keys only; the report's single pass carries its state (report.stream, build)
    ("doctor", ("doctor",)),
    ("report.accumulators", ("report.accumulators",)),
    ("report.policy+steps", ("report.policy", "report.steps")),
    ("report.stream", ("report.stream",)),
    ("report.verdict", ("report.verdict",)),
    ("report.render", ("report.render",)),
    ("report.build", ("report.build",)),
    ("gate", ("gate",)),
    # compare draws its page with the report's style and axes helpers (render), never its accumulators
    ("compare", ("compare",)),
    ("top", ("importers", "record", "pipeline", "locate", "environment", "testing")),
    ("cli", ("cli", "__main__")),
]
# Package modules that hold no code of their own, placed by name (a prefix would swallow their subpackages).
EXACT = {P: "leaves", f"{P}.report": "leaves"}
ONLY = {
    "doctor": ("frames", "report.keys", "report.numbers", "doctor", *LEAVES),  # numbers: how every interval reads
    "gate": METRICS_READERS_MAY_IMPORT,
    "compare": (*METRICS_READERS_MAY_IMPORT, "report.render"),
}
# Allowed only inside a function (built on demand, not at load): gate builds a missing report.
LAZY_ONLY = {"gate": ("report.build",), "compare": ("report.build",)}
ENGINE_ROOT = ("engines", "engines.base", "engines.cli_args", "engines.extras", "engines.options")
ENGINE_ROOT += ("engines.weight_files",)


# ---- reading the tree ------------------------------------------------------------------------------------


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(node: ast.Import | ast.ImportFrom, importer: str) -> list[str]:
    """The mismatch_probe modules one import statement loads: `from pkg import name` is pkg.name where that
    is a module, else pkg."""
    known = modules()
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in known]
    base = node.module or ""
    if node.level:  # relative: from the importer's package, up level - 1
        package = importer if is_package(importer) else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    found = []
    for alias in node.names:
        if f"{base}.{alias.name}" in known:
            found.append(f"{base}.{alias.name}")
        elif base in known:
            found.append(base)
    return list(dict.fromkeys(found))


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    lazy: bool  # inside a function: runs when called, not when the module loads

    def where(self) -> str:
        return f"{modules()[self.source].relative_to(ROOT)}:{self.line}"


@cache
def edges() -> list[Edge]:
    """Every executed import between mismatch_probe modules; `lazy` when inside a function. Imports under
    `if TYPE_CHECKING:` never run and are left out."""
    found: list[Edge] = []

    def visit(node: ast.AST, source: str, lazy: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, source, lazy)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _targets(node, source):
                if target != source:
                    found.append(Edge(source=source, target=target, line=node.lineno, lazy=lazy))
            return
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, source, inner)

    for name, path in modules().items():
        visit(ast.parse(path.read_text(), filename=str(path)), name, lazy=False)
    return found


def short(name: str) -> str:
    return name.removeprefix(f"{P}.")


def matches(name: str, prefixes: tuple[str, ...]) -> bool:
    rel = short(name)
    return any(rel == p or rel.startswith(f"{p}.") for p in prefixes)


def layer_of(name: str) -> str | None:
    if name in EXACT:
        return EXACT[name]
    best = None
    for layer, prefixes in LAYERS:
        for p in prefixes:
            if matches(name, (p,)) and (best is None or len(p) > len(best[1])):
                best = (layer, p)
    return best and best[0]


RANK = {layer: i for i, (layer, _) in enumerate(LAYERS)}


# ---- the rules ---------------------------------------------------------------------------------------------


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for e in edges():
        graph[e.source].add(e.target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path a->b->...->a."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:  # iterative, so a deep chain cannot hit the recursion limit
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.add(w)
                        if w == node:
                            break
                    if len(component) > 1:
                        components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(sorted(c)[0], c, graph) for c in components]


def _cycle_in(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest path from start back to start inside one component (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a component of >1 always has one


def edge_lines(a: str, b: str) -> str:
    lines = sorted({e.where() for e in edges() if e.source == a and e.target == b})
    return ", ".join(lines)


def test_cycle_finder_names_each_cycle_once():
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"f"}, "f": {"e", "d"}, "g": {"a"}}
    assert sorted(find_cycles(graph)) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle():
    cycles = find_cycles(import_graph())
    described = []
    for cycle in cycles:
        steps = [f"    {short(a)} -> {short(b)}  ({edge_lines(a, b)})" for a, b in zip(cycle, cycle[1:])]
        described.append("\n".join(steps))
    assert not cycles, "import cycles (function-local imports count):\n" + "\n\n".join(described)


def test_every_module_has_a_layer():
    unplaced = [m for m in modules() if layer_of(m) is None]
    assert not unplaced, f"modules in no layer of tests/test_layout.py LAYERS: {unplaced}"


def layer_violations() -> list[str]:
    found = []
    for e in edges():
        mine, theirs = layer_of(e.source), layer_of(e.target)
        if mine is None or theirs is None:
            continue  # test_every_module_has_a_layer names these
        if mine in ONLY:
            lazy_only = matches(e.target, LAZY_ONLY.get(mine, ()))
            allowed = matches(e.target, ONLY[mine]) or (e.lazy and lazy_only)
            why = "only inside a function" if lazy_only else "not among what it may import"
        else:
            allowed = RANK[theirs] <= RANK[mine]
            why = "a higher layer"
        if not allowed:
            found.append(f"  {e.where()}: {short(e.source)} [{mine}] imports {short(e.target)} [{theirs}]: {why}")
    return sorted(set(found))


def test_each_module_imports_only_its_own_layer_or_below():
    violations = layer_violations()
    order = " < ".join(layer for layer, _ in LAYERS)
    assert not violations, f"layer order ({order}) broken {len(violations)} times:\n" + "\n".join(violations)


def loaded_with(name: str) -> dict[str, str]:
    """Every module that loading `name` loads (imports at module level, followed), each with the module that
    imported it."""
    graph: dict[str, set[str]] = {}
    for e in edges():
        if not e.lazy:
            graph.setdefault(e.source, set()).add(e.target)
    by: dict[str, str] = {}
    todo = [name]
    while todo:
        node = todo.pop()
        for child in sorted(graph.get(node, ())):
            if child not in by and child != name:
                by[child] = node
                todo.append(child)
    return by


def chain(name: str, target: str, by: dict[str, str]) -> str:
    path = [target]
    while path[-1] != name:
        path.append(by[path[-1]])
    return " -> ".join(short(m) for m in reversed(path))


def test_metrics_readers_never_load_the_report_pass_or_an_engine():
    """gate, compare and doctor read metrics.json or frames: loading them, through any chain of module-level
    imports, loads no accumulator, no part of the report's pass and no engine."""
    heavy = ("report.accumulators", "report.stream", "engines")
    readers = [m for m in modules() if matches(m, ("gate", "compare", "doctor"))]
    bad = []
    for m in readers:
        by = loaded_with(m)
        # one line per way in: a heavy module loaded by one that is not
        bad += [f"  {chain(m, t, by)}" for t in sorted(by) if matches(t, heavy) and not matches(by[t], heavy)]
    assert not bad, "a metrics reader loads the report pass or an engine:\n" + "\n".join(bad)


def test_engine_root_imports_no_engine_subpackage_at_load():
    """The registry, protocols and --engine-arg parsing load without any backend (and so without torch)."""
    subpackages = tuple(
        f"engines.{d.name}" for d in sorted((PACKAGE / "engines").iterdir()) if (d / "__init__.py").exists()
    )
    root = {f"{P}.{m}" for m in ENGINE_ROOT}
    bad = [
        f"  {e.where()}: {short(e.source)} imports {short(e.target)}"
        for e in edges()
        if e.source in root and not e.lazy and matches(e.target, subpackages)
    ]
    assert not bad, "the engines/ root imports an engine subpackage at load:\n" + "\n".join(bad)


def test_no_folder_holds_more_than_fifteen_modules_flat():
    crowded = {
        str(folder.relative_to(ROOT)): n
        for folder in [PACKAGE, *sorted(p for p in PACKAGE.rglob("*") if p.is_dir())]
        if (n := len(list(folder.glob("*.py")))) > MAX_FLAT_MODULES
    }
    assert not crowded, f"folders over {MAX_FLAT_MODULES} .py modules: {crowded}"


def test_no_module_is_long():
    lengths = {path: len(path.read_text().splitlines()) for path in modules().values()}
    long = {str(p.relative_to(ROOT)): n for p, n in lengths.items() if n > MAX_LINES}
    keys = PACKAGE / "report" / "keys"
    catalogue = {
        str(p.relative_to(ROOT)): n for p, n in lengths.items() if keys in p.parents and n >= MAX_CATALOGUE_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"
    assert not catalogue, f"catalogue modules at {MAX_CATALOGUE_LINES} lines or more: {catalogue}"


# ---- the docs name paths that exist ------------------------------------------------------------------------

DOCS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").rglob("*.md"))]
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
PATH = re.compile(r"(?<![\w/.-])mismatch_probe/[\w./-]*")


def doc_paths(text: str) -> list[str]:
    """Every `mismatch_probe/...` inside a code span or fenced block, without a `:name` or `:123` suffix
    (the pattern stops at ':') and trailing punctuation."""
    found = []
    for span in CODE_SPAN.finditer(text):
        for path in PATH.findall(span.group(2)):
            found.append(path.rstrip(".,;)-"))
    return found


def test_doc_paths_drop_suffixes_and_read_fenced_blocks():
    text = "see `mismatch_probe/report/build.py:build_report`, `mismatch_probe/frames/`, and\n```\nmismatch_probe/x.py:12.\n```"
    assert doc_paths(text) == ["mismatch_probe/report/build.py", "mismatch_probe/frames/", "mismatch_probe/x.py"]


def test_every_mismatch_probe_path_in_the_docs_exists():
    missing = [
        f"  {doc.relative_to(ROOT)}: {path}"
        for doc in DOCS
        for path in doc_paths(doc.read_text())
        if not (ROOT / path).exists()
    ]
    assert not missing, "paths the docs name that do not exist:\n" + "\n".join(missing)
