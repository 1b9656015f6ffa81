"""Codegen's line breaking: generated source within the project's 100 columns.

Generated statements are written one per line; this breaks the few that are too long the way
a formatter does, from Python's own tokens (so strings and brackets are never misread):

- a trailing comment (the traced shape) moves to its own line above the statement;
- a statement ending in a bracket breaks inside it (`f(` / arguments / `)`), one argument per
  line with a trailing comma when they do not fit on one;
- an assignment whose value is a long operator expression or method chain is put in
  parentheses and broken before its loosest operators, or before each `.method(`;
- a long `key: value` entry of a multi-line literal breaks after its colon.

It is not a general formatter (codegen's output has few shapes); what it cannot break stays,
and the package's ruff check would name it.
"""

from __future__ import annotations

import io
import re
import tokenize

WIDTH = 100

_OPEN, _CLOSE = "([{", ")]}"
# loosest first: where a long expression breaks
_BREAK_OPERATORS = (("==", "!=", "<", "<=", ">", ">="), ("|",), ("^",), ("&",), ("+", "-"),
                    ("*", "/", "//", "%", "@"))


def wrap_source(text: str, width: int = WIDTH) -> str:
    """`text` with every line longer than `width` broken where it can be."""
    lines = text.split("\n")
    if all(len(line) <= width for line in lines):
        return text
    simple = _single_line_statements(text)
    out: list[str] = []
    for number, line in enumerate(lines, start=1):
        if len(line) <= width:
            out.append(line)
        elif number in simple:
            out.extend(wrap_line(line, width))
        else:
            out.extend(_wrap_entry(line, width))
    return "\n".join(out)


def _single_line_statements(text: str) -> set[int]:
    """Numbers of the lines that hold one whole statement each."""
    found: set[int] = set()
    start = None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENCODING):
                continue
            if start is None:
                start = tok.start[0]
            if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                if tok.start[0] == start:
                    found.add(start)
                start = None
    except (tokenize.TokenError, SyntaxError):
        return set()
    return found


def _tokens(code: str) -> list[tokenize.TokenInfo]:
    return [t for t in tokenize.generate_tokens(io.StringIO(code).readline)
            if t.type not in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER,
                              tokenize.INDENT, tokenize.DEDENT)]


def wrap_line(line: str, width: int = WIDTH) -> list[str]:
    """One statement's line, broken into lines within `width` where it can be."""
    indent = line[:len(line) - len(line.lstrip())]
    try:
        tokens = _tokens(line.strip())
    except (tokenize.TokenError, SyntaxError):
        return [line]
    comment = ""
    if tokens and tokens[-1].type == tokenize.COMMENT:
        comment = tokens[-1].string
        code = line.strip()[:tokens[-1].start[1]].rstrip()
    else:
        code = line.strip()
    lines = _wrap_code(code, indent, width)
    return ([indent + comment] if comment else []) + lines


def _pairs(tokens: list[tokenize.TokenInfo]) -> tuple[list[int], dict[int, int]]:
    """Each token's bracket depth, and where each bracket closes."""
    depth, stack = 0, []
    depths: list[int] = []
    closes: dict[int, int] = {}
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.OP and tok.string in _CLOSE:
            depth -= 1
            if stack:
                closes[stack.pop()] = i
        depths.append(depth)
        if tok.type == tokenize.OP and tok.string in _OPEN:
            stack.append(i)
            depth += 1
    return depths, closes


def _wrap_code(code: str, indent: str, width: int, inside: bool = False) -> list[str]:
    """Lines for one statement (or, `inside` brackets, one expression) at `indent`."""
    if len(indent) + len(code) <= width:
        return [indent + code]
    try:
        tokens = _tokens(code)
    except (tokenize.TokenError, SyntaxError):
        return [indent + code]
    if not tokens:
        return [indent + code]
    depths, closes = _pairs(tokens)
    inner = indent + "    "
    # a statement that ends in a bracket: break inside it
    bracketed = None
    last = len(tokens) - 1
    opening = next((i for i, j in closes.items() if j == last and depths[i] == 0), None)
    body = ""
    if opening is not None:
        head = code[:tokens[opening].end[1]]
        body = code[tokens[opening].end[1]:tokens[last].start[1]].strip()
        tail = code[tokens[last].start[1]:]
        if len(indent) + len(head) <= width and body:
            items = _split_top(body, ",")
            if len(inner) + len(body) <= width or len(items) == 1:
                lines = _wrap_code(body, inner, width, inside=True)
            else:
                call = tokens[opening].string != "(" or (opening > 0 and (
                    tokens[opening - 1].type == tokenize.NAME
                    or tokens[opening - 1].string in _CLOSE))
                lines = []
                for item in items:
                    lines.extend(_wrap_code(item.strip() + ",", inner, width, inside=True))
                if not call and len(items) == 1:  # `(a)` must not become the tuple `(a,)`
                    lines[-1] = lines[-1][:-1]
            bracketed = [indent + head, *lines, indent + tail]
    # a long expression: broken at its loosest operators (in parentheses, in a statement)
    broken = None
    target, value = "", code
    if not inside:
        equals = next((i for i, t in enumerate(tokens)
                       if depths[i] == 0 and t.type == tokenize.OP and t.string == "="), None)
        if equals is not None:
            target = code[:tokens[equals].end[1]] + " "
            value = code[tokens[equals].end[1]:].strip()
        elif tokens[0].string == "return":
            target, value = "return ", code[len("return"):].strip()
    parts = _break_expression(value)
    if len(parts) > 1:
        if inside:
            broken = [line for part in parts for line in _wrap_code(part, indent, width, True)]
        else:
            broken = [indent + target + "(",
                      *[line for part in parts for line in _wrap_code(part, inner, width, True)],
                      indent + ")"]
    if bracketed is not None and (broken is None or len(body) >= 30):
        return bracketed
    return broken or bracketed or [indent + code]


def _split_top(text: str, separator: str) -> list[str]:
    """`text` split at the `separator` tokens outside its brackets."""
    try:
        tokens = _tokens(text.strip())
    except (tokenize.TokenError, SyntaxError):
        return [text]
    stripped = text.strip()
    depths, _ = _pairs(tokens)
    parts, start = [], 0
    for i, tok in enumerate(tokens):
        if depths[i] == 0 and tok.type == tokenize.OP and tok.string == separator:
            parts.append(stripped[start:tok.start[1]])
            start = tok.end[1]
    rest = stripped[start:]
    if rest.strip():
        parts.append(rest)
    return parts


def _break_expression(value: str) -> list[str]:
    """Lines of a long expression: before each of its loosest top-level operators, else
    before each `.method(` of a chain."""
    try:
        tokens = _tokens(value)
    except (tokenize.TokenError, SyntaxError):
        return [value]
    depths, _ = _pairs(tokens)
    for symbols in _BREAK_OPERATORS:
        cuts = [i for i, t in enumerate(tokens) if depths[i] == 0 and t.type == tokenize.OP
                and t.string in symbols and i > 0 and _is_binary(tokens, i)]
        if cuts:
            return _cut(value, tokens, cuts)
    cuts = [i for i, t in enumerate(tokens)
            if depths[i] == 0 and t.string == "." and i > 0 and tokens[i - 1].string in _CLOSE]
    return _cut(value, tokens, cuts) if cuts else [value]


def _is_binary(tokens: list[tokenize.TokenInfo], i: int) -> bool:
    before = tokens[i - 1]
    return before.type in (tokenize.NAME, tokenize.NUMBER, tokenize.STRING) or \
        before.string in _CLOSE


def _cut(value: str, tokens: list[tokenize.TokenInfo], cuts: list[int]) -> list[str]:
    parts, start = [], 0
    for i in cuts:
        parts.append(value[start:tokens[i].start[1]].strip())
        start = tokens[i].start[1]
    parts.append(value[start:].strip())
    return [p for p in parts if p]


_ENTRY = re.compile(r"^(\s*)('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"): (.+)$")


def _wrap_entry(line: str, width: int) -> list[str]:
    """A long `'key': value,` line of a multi-line literal: the value on the next line."""
    m = _ENTRY.match(line)
    if m is None:
        return [line]
    indent, key, value = m.groups()
    return [f"{indent}{key}:", f"{indent}    {value}"]
