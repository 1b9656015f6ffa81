"""The import graph of atomc, read from the source with `ast` (imports at module level and inside
functions alike): no module imports itself round a cycle, and each package imports only the
layers below it, in the order of the pipeline (DESIGN 1):

    errors < jsonio, units, dtypes, device < ir < actions < trace < profile < simulate
      < partition < codegen < data < runtime < weights < calibrate < place < distributed < swarm
      < cli

Where the order was decided rather than read off the pipeline:
- `simulate` sits below `partition` (the cost model times its action lists with it) and below
  `runtime` (a measured trace becomes the simulator's Timeline): it needs only actions, ir and
  device.
- `codegen` sits below `runtime`: the runtime loads the packages codegen writes.
- `data` sits below `runtime`: it reads files into id streams and batches and needs only errors.
- `weights` sits above `runtime`: it reads into and writes out of a SwapPackage and a trainer.
- `place` sits above `calibrate` as in DESIGN's list, though it needs neither.
- every stage's entry point, `atomc/<package>/cli.py`, belongs to the `cli` layer: it composes
  its stage with the ones before it (`atomc partition --codegen` writes the package too).
Packages in one layer do not import each other.

KNOWN lists the upward imports still in the code, each with what removes it; an import that is
fixed must leave the list (the test fails on a stale entry), and a new one fails until fixed.
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
    ("runtime",),
    ("weights",),
    ("calibrate",),
    ("place",),
    ("distributed",),
    ("swarm",),
    ("cli",),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}

# (importer, imported) -> what removes it
KNOWN = {
    # the runtime's own costs are measured by running the runtime: profile_model should take
    # them from its caller (the profile entry point) or probe.py/runtime_costs.py move above
    # the runtime (calibrate)
    ("atomc.profile.probe", "atomc.runtime.package"): "runtime costs measured above the runtime",
    ("atomc.profile.probe", "atomc.runtime.executor"): "runtime costs measured above the runtime",
    ("atomc.profile.probe", "atomc.runtime.optim"): "runtime costs measured above the runtime",
    ("atomc.profile.probe", "atomc.runtime.trace"): "runtime costs measured above the runtime",
    ("atomc.profile.probe", "atomc.calibrate.measure"): "runtime costs measured above the runtime",
    ("atomc.profile.probe", "atomc.simulate.events"): "runtime costs measured above the runtime",
    ("atomc.profile.runtime_costs", "atomc.runtime.optim"): "runtime costs measured above the "
                                                            "runtime",
    # partition (owned elsewhere at the time of writing): the CPU optimizer's host cost
    ("atomc.partition.host", "atomc.runtime.optim"): "AdamW's settings below the runtime",
    # the trainer's weights= and save_pretrained open and write checkpoint files through
    # atomc.weights, which reads a SwapPackage and a trainer's store: the entry points (atomc
    # train/export, a script) should open and export, the trainer take what was opened
    ("atomc.runtime.trainer", "atomc.weights"): "weights opened and exported by the caller",
}


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
    if parts[1] in ("cli", "__main__") or parts[-1] == "cli":
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
