"""docs/api.md stays true: every symbol it documents imports, and every public symbol is documented.

What counts as *documented*: a code span that opens a heading, a bullet (``- `name(...)` ...``), a table row
(``| `Name` |``) or a paragraph, and names a symbol: a call signature (``name(...)``), a class or constant
(``Name``, ``NAME: type``), or a dotted path into one of the project's packages. Each is looked up, from
the innermost context outwards, in the class last documented, in the modules that the enclosing headings
name (``## `composer_replication.engine` ``, ``### Data (`engine.data`)``), and in the package roots.
Parameter lists (``- `recipe_path: str | None` — ...``) and config fields (``| `alpha_sdpo` |``) are
lower-case names without a signature: they are not symbols and are not looked up.

What counts as *public*: ``__all__`` of ``composer_replication`` and each of its subpackages, of ``meshes``,
and of every module of ``recipes.monarch``, ``recipes.prime_rl`` and ``recipes.serverless`` that defines one
(names with a leading underscore excepted). A public name is documented when some code span on the page
starts with it, bare or qualified (``Name``, ``module.Name(...)``, ``class Name``).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "api.md"
ROOTS = ("composer_replication", "meshes", "recipes", "benchmarks")
LAST = ("builtins",)  # `ValueError` and friends, looked up last
PUBLIC_PACKAGES = (
    "composer_replication",
    "meshes",
    "recipes.monarch",
    "recipes.prime_rl",
    "recipes.serverless",
)

_SPAN = re.compile(r"`([^`\n]+)`")
_DECORATION = re.compile(r"^(?:@dataclass(?:\([^)]*\))?\s+|@staticmethod\s+|class\s+|async\s+|def\s+)*")
_PATH = re.compile(r"^(?P<path>[A-Za-z_][\w.]*[\w])(?P<rest>.*)$", re.S | re.ASCII)
_MISSING = object()


def lookup(dotted: str) -> Any:
    """The object at ``a.b.C.d`` (longest importable module prefix, then attributes), or ``_MISSING``."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, _MISSING)
            if obj is _MISSING:
                return _MISSING
        return obj
    return _MISSING


def symbol_of(span: str) -> str | None:
    """The dotted name a code span documents, or None when the span is a parameter, a field, or prose."""
    m = _PATH.match(_DECORATION.sub("", span.strip()))
    if not m:
        return None
    path, rest = m.group("path"), m.group("rest")
    if rest.lstrip().startswith("=") and not rest.lstrip().startswith("=="):
        return None  # a formula or an assignment in prose
    if rest.startswith("(") or path.split(".")[0] in ROOTS or path.rsplit(".", 1)[-1][:1].isupper():
        return path
    return None


def _module_named(span: str, contexts: list[str]) -> str | None:
    """The module a heading's code span names (``engine.data`` under ``composer_replication``), if any."""
    if not re.fullmatch(r"[A-Za-z_][\w.]*", span):
        return None
    for candidate in [span, *(f"{c}.{span}" for c in contexts)]:
        if isinstance(lookup(candidate), ModuleType):
            return candidate
    return None


def logical_lines(text: str) -> Iterator[tuple[int, str, bool]]:
    """``(line number, line, starts a paragraph)`` outside code fences; a line whose code span goes on to
    the next lines (an odd number of backticks) is joined with them, so a wrapped signature is one span."""
    lines = text.splitlines()
    fence, previous, i = False, "", 0
    while i < len(lines):
        no, line = i + 1, lines[i]
        i += 1
        if line.lstrip().startswith("```"):
            fence, previous = not fence, line
            continue
        if fence:
            continue
        paragraph_start, previous = not previous.strip(), line
        while (
            line.count("`") % 2
            and i < len(lines)
            and lines[i].strip()
            and not lines[i].lstrip().startswith("```")
        ):
            line, i = f"{line} {lines[i].strip()}", i + 1
        yield no, line, paragraph_start


def page_spans(text: str) -> list[str]:
    """Every code span of the page outside code fences."""
    return [span for _, line, _ in logical_lines(text) for span in _SPAN.findall(line)]


def documented_symbols(text: str) -> Iterator[tuple[int, str, list[str]]]:
    """``(line number, span, contexts to look it up in)`` for each symbol the page documents."""
    levels: dict[int, list[str]] = {}  # heading level -> modules named by that heading
    klass: str | None = None
    for no, line, paragraph_start in logical_lines(text):
        spans = _SPAN.findall(line)
        if not spans:
            continue
        heading = re.match(r"^(#+) ", line)
        if heading:
            level = len(heading.group(1))
            levels = {k: v for k, v in levels.items() if k < level}
            outer = [m for k in sorted(levels, reverse=True) for m in levels[k]]
            roots = [*outer, *ROOTS]
            levels[level] = [m for s in spans if (m := _module_named(s, roots))]
            klass = None
            candidates = [s for s in spans if s not in levels[level]]
        elif re.match(r"^(?:- |\| )`", line) or (paragraph_start and line.startswith("`")):
            candidates = spans[:1]
        else:
            continue
        modules = [m for k in sorted(levels, reverse=True) for m in levels[k]]
        for span in candidates:
            name = symbol_of(span)
            if name is None:
                continue
            contexts = [c for c in (klass, *modules, *ROOTS, *LAST) if c]
            if "." in name and not name.split(".")[0][:1].isupper() and _resolve(name, contexts) is _MISSING:
                if lookup(name.split(".")[0]) is _MISSING:
                    continue  # `inner_optimizer.step()`: a call on a parameter, not a symbol of ours
            yield no, span, contexts
            obj = _resolve(name, contexts)
            if isinstance(obj, type):
                klass = _where(name, contexts)


def _candidates(name: str, contexts: list[str]) -> list[str]:
    first = (
        [name] if "." in name else []
    )  # absolute: ours (`meshes.hosts`) or a library's (`httpx.AsyncClient`)
    return [*first, *(f"{c}.{name}" for c in contexts)]


def _resolve(name: str, contexts: list[str]) -> Any:
    for candidate in _candidates(name, contexts):
        obj = lookup(candidate)
        if obj is not _MISSING:
            return obj
    return _MISSING


def _where(name: str, contexts: list[str]) -> str | None:
    return next((c for c in _candidates(name, contexts) if lookup(c) is not _MISSING), None)


def public_symbols() -> dict[str, list[str]]:
    """``{module: [public names]}`` for the packages of PUBLIC_PACKAGES (see the module docstring)."""
    out: dict[str, list[str]] = {}
    for pkg_name in PUBLIC_PACKAGES:
        pkg = importlib.import_module(pkg_name)
        modules = [pkg]
        if pkg_name == "composer_replication":  # the package and every subpackage's __init__
            modules += [
                importlib.import_module(m.name)
                for m in pkgutil.walk_packages(pkg.__path__, "composer_replication.")
                if m.ispkg
            ]
        elif not hasattr(pkg, "__all__"):  # recipes.*: each module's own __all__
            modules += [
                importlib.import_module(f"{pkg_name}.{m.name}")
                for m in pkgutil.iter_modules(pkg.__path__)
                if not m.ispkg and m.name != "__main__"
            ]
        for mod in modules:
            names = [n for n in getattr(mod, "__all__", ()) if not n.startswith("_")]
            if names:
                out[mod.__name__] = names
    return out


def _is_documented(name: str, spans: list[str]) -> bool:
    pattern = re.compile(
        rf"^(?:class |async |def |@dataclass(?:\([^)]*\))? (?:class )?)?(?:[\w.]+\.)?{re.escape(name)}\b"
    )
    return any(pattern.match(s.strip()) for s in spans)


# ---------------------------------------------------------------------------- tests


def test_every_documented_symbol_imports():
    text = PAGE.read_text(encoding="utf-8")
    entries = list(documented_symbols(text))
    assert len(entries) > 100, "the parser found almost nothing on docs/api.md: did the page's layout change?"
    broken = [
        f"docs/api.md:{no}: `{span[:70]}` (looked up in {', '.join(ctx[:3])}, ...)"
        for no, span, ctx in entries
        if _resolve(symbol_of(span) or "", ctx) is _MISSING
    ]
    assert not broken, (
        "symbols documented in docs/api.md that do not import (rename them, qualify them with "
        "their module, or remove them):\n" + "\n".join(broken)
    )


def test_every_public_symbol_is_documented():
    spans = page_spans(PAGE.read_text(encoding="utf-8"))
    missing = [
        f"{mod}.{name}"
        for mod, names in public_symbols().items()
        for name in names
        if not _is_documented(name, spans)
    ]
    assert not missing, (
        "public symbols (in __all__) that docs/api.md does not document; add a line for each "
        "(signature and meaning) to its module's section:\n" + "\n".join(missing)
    )


@pytest.mark.parametrize(
    ("span", "symbol"),
    [
        ("train_step(step: int) -> dict[str, float]", "train_step"),
        ("class Foo(Base)", "Foo"),
        ("@dataclass(kw_only=True) class Prompt", "Prompt"),
        ("SYSTEM_PROMPT: str", "SYSTEM_PROMPT"),
        ("meshes.hosts", "meshes.hosts"),
        ("recipe_path: str | None", None),
        ("alpha_sdpo", None),
        ("python -m benchmarks", None),
        ("loss/total", None),
    ],
)
def test_what_counts_as_a_symbol(span, symbol):
    assert symbol_of(span) == symbol


def test_the_checks_catch_a_wrong_page():
    page = "## `meshes`\n\n- `local_meshes(*, num_replicas=1)` - spawn.\n- `no_such_function(x)` - gone.\n"
    entries = list(documented_symbols(page))
    assert [span for _, span, ctx in entries if _resolve(symbol_of(span) or "", ctx) is _MISSING] == [
        "no_such_function(x)"
    ]
    assert _is_documented("local_meshes", page_spans(page))
    assert not _is_documented("attach_meshes", page_spans(page))
    wrapped = "- `class Env(tasks=None, *,\n  timeout_s=5.0)` - wraps.\n\n```python\n`Hidden`\n```\n"
    assert [span for _, span, _ in documented_symbols(wrapped)] == ["class Env(tasks=None, *, timeout_s=5.0)"]
    assert not _is_documented("Hidden", page_spans(wrapped))  # code fences are not documentation
