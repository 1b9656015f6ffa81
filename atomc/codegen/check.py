"""Codegen, step 3: check and tidy rendered sources (scopes from Python's symbol tables, edits with
libcst); copy the model file's helpers.

Input: rendered source text, and the model file for helpers. Output: source text that parses,
whose imports are exactly those it uses (sorted: standard library, third party, the package),
and that uses no undefined name; and `_helpers.py`, the top-level functions and classes of the
model file the graph calls, with everything they need from that file (other functions,
constants, imports), so the generated package imports without the model file.
"""

from __future__ import annotations

import ast
import builtins
import symtable
import sys
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
from libcst.metadata import (
    BuiltinScope,
    GlobalScope,
    ImportAssignment,
    MetadataWrapper,
    PositionProvider,
    ScopeProvider,
)

from atomc.errors import CodegenError

_MODULE_DUNDERS = {"__name__", "__file__", "__doc__", "__spec__", "__package__", "__loader__",
                   "__builtins__", "__class__", "__annotations__", "__dict__", "__path__"}
_BUILTINS = set(dir(builtins))


def parse(code: str, filename: str) -> cst.Module:
    try:
        return cst.parse_module(code)
    except cst.ParserSyntaxError as e:
        raise CodegenError(f"generated {filename} does not parse ({e.message} at line "
                           f"{e.raw_line}); this is a bug in atomc's templates: please report it "
                           f"with the plan") from None


# ---------------------------------------------------------------------------------------------
# imports


@dataclass(frozen=True)
class _Import:
    module: str  # "torch.nn.functional" or ".submodel_0"; "" for `import x`
    name: str  # the imported name (module path for `import x`)
    asname: str | None

    def group(self) -> int:
        root = (self.module or self.name)
        if root == "__future__":
            return 0
        if root.startswith("."):
            return 3
        top = root.split(".")[0]
        return 1 if top in sys.stdlib_module_names else 2


def _dotted(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_dotted(node.value)}.{node.attr.value}"
    raise ValueError(node)


def _imports_of(stmt: cst.CSTNode) -> list[_Import] | None:
    """The imports a top-level `import`/`from ... import` line makes; None for anything else."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    small = stmt.body[0]
    if isinstance(small, cst.Import):
        return [_Import("", _dotted(a.name), a.asname.name.value if a.asname else None)
                for a in small.names]
    if isinstance(small, cst.ImportFrom):
        if isinstance(small.names, cst.ImportStar):
            return None
        module = "." * len(small.relative) + (_dotted(small.module) if small.module else "")
        return [_Import(module, _dotted(a.name), a.asname.name.value if a.asname else None)
                for a in small.names]
    return None


def _format_imports(imports: list[_Import]) -> list[str]:
    """Sorted import lines, grouped; `from m import a, b` merged per module."""
    lines: list[tuple[int, str, str]] = []
    froms: dict[str, list[_Import]] = {}
    for imp in set(imports):
        if imp.module:
            froms.setdefault(imp.module, []).append(imp)
        else:
            text = f"import {imp.name}" + (f" as {imp.asname}" if imp.asname else "")
            lines.append((imp.group(), imp.name, text))
    for module, items in froms.items():
        items = sorted(items, key=lambda i: (_member_rank(i.name), i.name.lower(), i.name))
        names = [f"{i.name} as {i.asname}" if i.asname else i.name for i in items]
        lines.append((items[0].group(), module, f"from {module} import {', '.join(names)}"))
    # isort's order, as ruff checks it: per section `import x` lines, then `from x import y`
    lines.sort(key=lambda t: (t[0], t[2].startswith("from"), t[1].lower(), t[2]))
    out: list[str] = []
    previous = None
    for group, _, text in lines:
        if previous is not None and group != previous:
            out.append("")
        out.append(text)
        previous = group
    return out


def _member_rank(name: str) -> int:
    """isort's order-by-type: CONSTANTS, then Classes, then functions and variables."""
    if name.isupper() and len(name) > 1:
        return 0
    return 1 if name[:1].isupper() else 2


def _tidy(module: cst.Module, reads: set[str]) -> str:
    keep: list[_Import] = []
    body: list[cst.BaseStatement] = []
    for stmt in module.body:
        imports = _imports_of(stmt)
        if imports is None:
            body.append(stmt)
            continue
        for imp in imports:
            bound = {imp.asname} if imp.asname else ({imp.name} if imp.module else
                                                      {imp.name, imp.name.split(".")[0]})
            if imp.group() == 0 or bound & reads:
                keep.append(imp)
    docstring: list[cst.BaseStatement] = []
    if body and _is_docstring(body[0]):
        docstring, body = [body[0]], body[1:]
    import_stmts = []
    blank = False
    for i, line in enumerate(_format_imports(keep)):
        if not line:
            blank = True
            continue
        stmt = cst.parse_statement(line + "\n")
        lead = [cst.EmptyLine()] if (blank or (i == 0 and docstring)) else []
        import_stmts.append(stmt.with_changes(leading_lines=lead))
        blank = False
    if body and import_stmts:
        comments = [ln for ln in body[0].leading_lines if ln.comment is not None]
        blank = [cst.EmptyLine()] * (2 if _is_definition(body[0]) else 1)
        body[0] = body[0].with_changes(leading_lines=[*blank, *comments])
    elif body and docstring:
        comments = [ln for ln in body[0].leading_lines if ln.comment is not None]
        body[0] = body[0].with_changes(leading_lines=[cst.EmptyLine(), *comments])
    return module.with_changes(body=[*docstring, *import_stmts, *body]).code


def _is_definition(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, (cst.ClassDef, cst.FunctionDef))


def _is_docstring(stmt: cst.CSTNode) -> bool:
    return (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1
            and isinstance(stmt.body[0], cst.Expr)
            and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString)))


# ---------------------------------------------------------------------------------------------
# undefined names


def _global_reads(code: str, filename: str, tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names the module binds at its top level, names read from the module's globals anywhere
    in it, annotations included).

    Python's own symbol tables resolve the scopes (symtable), as the compiler will: a tenth of
    the time of libcst's scope analysis on generated sub-models."""
    top = symtable.symtable(code, filename, "exec")
    bound = {s.get_name() for s in top.get_symbols()
             if s.is_assigned() or s.is_imported() or s.is_namespace()}
    reads = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    todo = list(top.get_children())
    while todo:
        table = todo.pop()
        todo.extend(table.get_children())
        for sym in table.get_symbols():
            if sym.is_declared_global() and sym.is_assigned():
                bound.add(sym.get_name())
            if sym.is_referenced() and sym.is_global():
                reads.add(sym.get_name())
    # under `from __future__ import annotations` the symbol tables skip annotations, which
    # still name what they mean (and what a type checker and ruff resolve)
    return bound, reads | _annotation_names(tree)


def _annotation_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()

    def collect(node: ast.AST | None) -> None:
        for sub in ast.walk(node) if node is not None else ():
            if isinstance(sub, ast.Name):
                names.add(sub.id)
            elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                try:
                    collect(ast.parse(sub.value, mode="eval"))
                except SyntaxError:
                    pass  # a string that is not an expression names nothing

    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign):
            collect(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None:
                    collect(arg.annotation)
            collect(node.returns)
    return names


def _undefined(tree: ast.Module, names: set[str]) -> list[tuple[str, int]]:
    """(name, line of its first read) for `names`."""
    first: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in names:
            first[node.id] = min(first.get(node.id, node.lineno), node.lineno)
    return sorted(((n, first.get(n, 0)) for n in names), key=lambda t: (t[1], t[0]))


def check_source(code: str, filename: str, copied_from: str | None = None) -> str:
    """Parse, refuse undefined names, tidy imports; the tidied code.

    `copied_from` names the model file for code copied out of it, whose undefined names are
    the model file's doing rather than atomc's.

    One scope analysis serves both: tidying only drops imports nothing reads, so it cannot
    make a name undefined.
    """
    module = parse(code, filename)
    tree = ast.parse(code, filename)  # libcst parsed it: it parses
    bound, reads = _global_reads(code, filename, tree)
    missing = _undefined(tree, reads - bound - _BUILTINS - _MODULE_DUNDERS)
    if missing:
        listed = ", ".join(f"{name} (line {line})" for name, line in missing[:8])
        if copied_from is not None:
            raise CodegenError(
                f"the helpers copied from {copied_from} into {filename} use names that file does "
                f"not define at its top level: {listed}; atomc copies top-level definitions and "
                f"imports only: define them there")
        raise CodegenError(f"generated {filename} uses undefined names: {listed}; this is a bug in "
                           f"atomc's code generation: please report it with the plan")
    return _tidy(module, reads)


# ---------------------------------------------------------------------------------------------
# helpers


@dataclass
class _TopLevel:
    """The model file's top-level statements and what links them: which statements bind each
    name, which statements each one reads from, and which imported names are read."""
    module: cst.Module
    body: list[cst.CSTNode]
    binders: dict[str, list[int]]  # name -> statements that bind it
    deps: dict[int, set[int]]  # statement -> statements whose names it reads
    import_names: dict[int, set[str]]  # import statement -> bound names that are read


def _top_level(module: cst.Module) -> _TopLevel:
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    scopes = wrapper.resolve(ScopeProvider)
    positions = wrapper.resolve(PositionProvider)
    body = list(module.body)
    spans = [(positions[getattr(s, "decorators", None)[0] if getattr(s, "decorators", None) else s]
               .start.line, positions[s].end.line) for s in body]

    def statement_of(node: cst.CSTNode) -> int:
        line = positions[node].start.line
        for i, (start, end) in enumerate(spans):
            if start <= line <= end:
                return i
        raise AssertionError(line)

    all_scopes = list({id(s): s for s in scopes.values() if s is not None}.values())
    global_scope = next(s for s in all_scopes if isinstance(s, GlobalScope))
    binders: dict[str, list[int]] = {}
    for assignment in global_scope.assignments:
        if isinstance(assignment.scope, BuiltinScope):
            continue
        binders.setdefault(assignment.name, []).append(statement_of(assignment.node))
    deps: dict[int, set[int]] = {i: set() for i in range(len(body))}
    import_names: dict[int, set[str]] = {}
    for scope in all_scopes:
        for access in scope.accesses:
            user = statement_of(access.node)
            for ref in access.referents:
                if ref.scope is not global_scope or isinstance(ref.scope, BuiltinScope):
                    continue
                if not hasattr(ref, "node"):
                    continue
                where = statement_of(ref.node)
                deps[user].add(where)
                if isinstance(ref, ImportAssignment):
                    import_names.setdefault(where, set()).add(ref.name)
    return _TopLevel(module, body, binders, deps, import_names)


def _needed_statements(top: _TopLevel, wanted: dict[str, str],
                       model_path: Path) -> tuple[set[int], dict[int, str]]:
    """The statements `wanted` needs, transitively, each with the wanted name that pulled it in;
    `from __future__` imports always, since they change what the rest means."""
    needed: set[int] = set()
    reason: dict[int, str] = {}
    todo: list[int] = []
    for name, why in sorted(wanted.items()):
        if name not in top.binders:
            raise CodegenError(f"{why} uses {name}, which {model_path.name} does not define at the "
                               f"top level in its source; atomc cannot copy it into the generated "
                               f"package")
        for i in top.binders[name]:
            if i not in needed:
                needed.add(i)
                reason[i] = f"{name} (needed by {why})"
                todo.append(i)
    while todo:
        i = todo.pop()
        for j in sorted(top.deps[i]):
            if j not in needed:
                needed.add(j)
                reason[j] = reason[i]
                todo.append(j)

    for i, stmt in enumerate(top.body):  # `from __future__ import annotations` changes semantics
        if any(imp.module == "__future__" for imp in _imports_of(stmt) or []):
            needed.add(i)
            top.import_names.setdefault(i, set()).update(
                imp.name for imp in _imports_of(stmt) or [])
    return needed, reason


def _copied_imports(top: _TopLevel, i: int, imports: list[_Import], reason: str,
                    is_installed) -> list[str]:
    """The import lines statement `i` contributes: only the names something needed reads, and
    only from modules the generated package can import on another machine."""
    out: list[str] = []
    for imp in imports:
        bound = imp.asname or imp.name
        names = {bound, bound.split(".")[0]} if not imp.module and not imp.asname else {bound}
        if not names & top.import_names.get(i, set()):
            continue
        target = imp.module or imp.name
        if target.startswith("."):
            raise CodegenError(
                f"{reason} needs `{top.module.code_for_node(top.body[i]).strip()}`, a relative "
                f"import that does not resolve outside the model's directory; atomc cannot copy "
                f"it: import it absolutely from an installed package, or define it in the model "
                f"file")
        if target != "__future__" and not is_installed(target):
            raise CodegenError(
                f"{reason} needs module {target}, which is neither the model file nor an "
                f"installed package, so the generated package could not import it on another "
                f"machine; move what it uses into the model file, or install the module")
        if imp.module:
            alias = f" as {imp.asname}" if imp.asname else ""
            out.append(f"from {imp.module} import {imp.name}{alias}\n")
        else:
            out.append(f"import {imp.name}"
                       + (f" as {imp.asname}" if imp.asname else "") + "\n")
    return out


def copy_helpers(model_path: Path, wanted: dict[str, str], is_installed, header: str) -> str:
    """`_helpers.py`: the model file's top-level definitions `wanted` (name -> who needs it) and
    everything they read from the model file, in the file's order, with the imports they use.

    `is_installed(module_name)` says whether an import can be kept (stdlib or installed package).
    """
    try:
        source = model_path.read_text(encoding="utf-8")
    except OSError as e:
        raise CodegenError(f"cannot read {model_path} to copy its helpers ({e}); keep the model "
                           f"file next to the plan while generating code") from None
    module = parse(source, str(model_path))
    top = _top_level(module)
    needed, reason = _needed_statements(top, wanted, model_path)

    out: list[str] = []
    for i in sorted(needed):
        stmt = top.body[i]
        imports = _imports_of(stmt)
        if imports is None:
            out.append("\n\n" + module.code_for_node(stmt.with_changes(
                leading_lines=[ln for ln in stmt.leading_lines if ln.comment is not None])))
            continue
        out += _copied_imports(top, i, imports, reason.get(i, ""), is_installed)
    text = f'"""{header}"""\n\n' + "".join(
        line if line.endswith("\n") else line + "\n" for line in out)
    return text
