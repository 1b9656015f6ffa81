"""The import graph of atomc, read from the source with `ast` (imports at module level and inside
functions alike): no module imports itself round a cycle, and each package imports only the
layers below it, in the order of the pipeline (docs/design.md, section "One chain of stages,
one IR"):

    errors < jsonio, units, dtypes, device < ir < actions < trace < profile < simulate
      < partition < codegen < data < weights < runtime < stages < calibrate < place < distributed
      < swarm < cli

Where the order was decided rather than read off the pipeline:
- `simulate` sits below `partition` (the cost model times its action lists with it) and below
  `runtime` (a measured trace becomes the simulator's Timeline): it needs only actions, ir and
  device.
- `codegen` sits below `runtime`: the runtime loads the packages codegen writes.
- `stages` sits right above `runtime`: a stage runs its action lists through the runtime's
  interpreter, the swapped one on the swap executor; the layout runner (`distributed`) and
  SWARM's servers hold stages.
- `data` sits below `runtime`: it reads files into id streams and batches and needs only errors.
- `weights` sits below `runtime`: the trainer opens checkpoints (`weights=`) and exports
  (`save_pretrained`) through it, and it reads the package, the trainer and its store by the
  attributes it names (weights.names.SwapPackageLike, a Protocol), not by the runtime's types.
- the runtime's own costs (`calibrate.runtime_costs`, `calibrate.probe`) are measured by
  running the runtime, so they sit above it; `atomc profile` hands them to profile_model.
- `place` sits above `calibrate` as in DESIGN's list, though it needs neither.
- `cli`, the `atomc` command (a module per command group, and `atomc/__main__.py`), sits above
  every stage: a command composes its stage with the ones before it (`atomc partition --emit`
  writes the package too).
Packages in one layer do not import each other, and no module imports a private name
(`_name`) of another package.

KNOWN lists the upward imports still in the code, each with what removes it; an import that is
fixed must leave the list (the test fails on a stale entry), and a new one fails until fixed.

One name, one concept: a public name is defined at the top level of one module only, so that
`Stage` or `search` means one thing wherever it is read. SHARED_NAMES lists the names still
defined in several modules, each with why; as with KNOWN, a name that is fixed must leave it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1] / "atomc"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("atomc", "errors"),
    ("jsonio", "units", "dtypes", "device"),
    ("ir",),
    ("actions",),
    ("trace",),
    ("profile",),
    ("simulate",),
    ("partition",),
    ("codegen",),
    ("data",),
    ("weights",),
    ("runtime",),
    ("stages",),
    ("calibrate",),
    ("place",),
    ("distributed",),
    ("swarm",),
    ("compare",),
    ("cli",),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}

# (importer, imported) -> what removes it
KNOWN: dict[tuple[str, str], str] = {}


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The atomc modules `name` imports, anywhere in it (a package's `from atomc.x import y`
    counts as atomc.x.y when y is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "atomc"
    if parts[1] == "__main__":  # `python -m atomc`: the command line
        return "cli"
    return parts[1]


def graph() -> nx.DiGraph:
    known = modules()
    g = nx.DiGraph()
    g.add_nodes_from(known)
    for name, path in known.items():
        g.add_edges_from((name, t) for t in imported(name, path, known))
    return g


def test_every_package_has_a_layer() -> None:
    assert {layer(m) for m in graph()} <= set(RANK)


def test_no_module_imports_itself_round_a_cycle() -> None:
    cycles = list(nx.simple_cycles(graph()))
    assert cycles == [], f"import cycles: {cycles}"


def test_packages_import_only_the_layers_below_them() -> None:
    g = graph()
    upward = {(a, b) for a, b in g.edges
              if layer(a) != layer(b) and RANK[layer(b)] >= RANK[layer(a)]}
    new = sorted(upward - KNOWN.keys())
    assert new == [], "imports of a layer above (or beside) the importer's: " + ", ".join(
        f"{a} -> {b}" for a, b in new)
    stale = sorted(KNOWN.keys() - upward)
    assert stale == [], f"no longer imported, drop them from KNOWN: {stale}"
    # what is left of the package graph once the known exceptions go is a DAG
    packages = nx.DiGraph((layer(a), layer(b)) for a, b in g.edges
                          if layer(a) != layer(b) and (a, b) not in KNOWN)
    assert nx.is_directed_acyclic_graph(packages), list(nx.simple_cycles(packages))


def test_the_graph_reader_sees_imports_inside_functions(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from atomc.runtime import package\n    import atomc.swarm.wire\n")
    known = {"atomc.runtime": ROOT, "atomc.runtime.package": ROOT, "atomc.swarm.wire": ROOT}
    assert imported("atomc.x", src, known) == {"atomc.runtime.package", "atomc.swarm.wire"}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def private_imports(name: str, path: Path) -> set[tuple[str, str]]:
    """(module, name) of each `from atomc.x import _name` in `name` (its file `path`) whose
    module lies in another package than `name`'s."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            pkg = pkg[:len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        if not base.startswith("atomc") or package_of(base) == package_of(name):
            continue
        out.update((base, a.name) for a in node.names
                   if a.name.startswith("_") and not a.name.startswith("__"))
    return out


def test_no_module_imports_another_packages_private_names() -> None:
    found = sorted((name, *imp) for name, path in modules().items()
                   for imp in private_imports(name, path))
    assert found == [], "private names imported across packages (give them a public name): " + (
        ", ".join(f"{a} imports {b}.{c}" for a, b, c in found))


def test_the_private_name_reader_sees_other_packages_only(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from atomc.trace import _hidden, shown\nfrom atomc.runtime.store import _own\n"
                   "from atomc import __version__\n\ndef f():\n    from ..trace import _late\n")
    assert private_imports("atomc.runtime.trainer", src) == {("atomc.trace", "_hidden"),
                                                             ("atomc.trace", "_late")}


TESTS = Path(__file__).resolve().parent
# generated packages and model files the tests read, not test code
NOT_TEST_CODE = ("golden", "fixtures", "models", "shims")


def imported_test_files(path: Path) -> set[str]:
    """The test files (test_*.py, conftest.py) that `path` imports by module name."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        last = [n.rpartition(".")[2] for n in names]
        out.update(n for n, m in zip(names, last) if m.startswith("test_") or m == "conftest")
    return out


def test_no_test_file_imports_another_test_file() -> None:
    """What tests share lives in tests/helpers/ (or conftest.py's fixtures), so each test file
    can be read, run and changed on its own."""
    found = {str(p.relative_to(TESTS)): sorted(imported_test_files(p))
             for p in TESTS.rglob("*.py")
             if p.relative_to(TESTS).parts[0] not in NOT_TEST_CODE and imported_test_files(p)}
    assert found == {}, f"test files imported by others (move what they share to helpers): {found}"


def test_the_test_import_reader_sees_test_modules(tmp_path: Path) -> None:
    src = tmp_path / "test_m.py"
    src.write_text("import test_models as base\nfrom helpers.plain import plain_run\n\n"
                   "def f():\n    from test_runtime import plain_run\n    import conftest\n")
    assert imported_test_files(src) == {"test_models", "test_runtime", "conftest"}


# public top-level name defined in several modules -> why it still is (and what fixes it)
PENDING = "pending: runtime redesign (issue 41)"
SHARED_NAMES: dict[str, str] = {
    # one meaning: what atomc.cli.build_parser calls in each module of the command line
    "register": "every atomc/cli/ module adds its subcommands to the parser so",
    # in packages being redesigned now; the closing note proposes a name for each
    "ACTIVATIONS": PENDING,
    "BOUND": PENDING,
    "COMPUTE_OPS": PENDING,
    "COPY_BYTES": PENDING,
    "Comparison": PENDING,
    "DTYPE_BYTES": PENDING,
    "INF": PENDING,
    "KINDS": PENDING,
    "LANES": PENDING,
    "Links": PENDING,
    "MODES": PENDING,
    "NS_PER_MS": PENDING,
    "REQUIRED": PENDING,
    "SAMPLE_MS": PENDING,
    "WIDTH": PENDING,
    "check_plan": PENDING,
    "compare": PENDING,
    "model_dtype": PENDING,
    "op_name": PENDING,
    "render": PENDING,
    "store_mode": PENDING,
    "summarise": PENDING,
    "to_data": PENDING,
}


def top_level_names(path: Path) -> set[str]:
    """The public names `path` defines at its top level: functions, classes and assignments,
    also under a top-level `if` or `try` (imports are not definitions)."""
    out: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                out.update(n.id for t in targets for n in ast.walk(t)
                           if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                if isinstance(node, ast.Try):
                    visit(node.finalbody)
                    for h in node.handlers:
                        visit(h.body)

    visit(ast.parse(path.read_text(), str(path)).body)
    return {n for n in out if not n.startswith("_")}


def test_no_public_name_is_defined_in_two_modules() -> None:
    where: dict[str, list[str]] = {}
    for module, path in sorted(modules().items()):
        for n in top_level_names(path):
            where.setdefault(n, []).append(module)
    doubled = {n: ms for n, ms in where.items() if len(ms) > 1}
    new = {n: ms for n, ms in sorted(doubled.items()) if n not in SHARED_NAMES}
    assert new == {}, ("public names defined in several modules (give each concept one name, "
                       "or list the name in SHARED_NAMES with why it stays): " + "; ".join(
                           f"{n} in {', '.join(ms)}" for n, ms in new.items()))
    stale = sorted(SHARED_NAMES.keys() - doubled.keys())
    assert stale == [], f"defined in one module now, drop them from SHARED_NAMES: {stale}"


def test_the_name_reader_sees_definitions_not_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from x import y\nimport z\nA = B = 1\nc: int = 2\n_hidden = 3\n"
                   "def f():\n    inner = 1\nclass K:\n    attr = 1\n"
                   "try:\n    import w\nexcept ImportError:\n    w = None\n"
                   "if True:\n    g, (h, i) = 1, (2, 3)\n")
    assert top_level_names(src) == {"A", "B", "c", "f", "K", "w", "g", "h", "i"}


# a module a newcomer reads in one sitting, a function that fits on a screen
MODULE_LINES = 600
FUNCTION_LINES = 80


def test_modules_and_functions_stay_readable() -> None:
    long_modules, long_functions = [], []
    for module, path in sorted(modules().items()):
        text = path.read_text()
        if len(text.splitlines()) > MODULE_LINES:
            long_modules.append(f"{module} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    long_functions.append(f"{module}.{node.name} ({lines} lines)")
    assert long_modules == [], f"split these modules where their jobs split: {long_modules}"
    assert long_functions == [], f"split these functions: {long_functions}"
