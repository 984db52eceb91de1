"""Facts of a test run, and how the parent judges them (stdlib only: imported by the parent and by the child).

A test passes when the *parent* says so, from plain data the child reported, so that no object of
the candidate's can vote on its own result (an ``__eq__`` that always returns ``True``, say).

- :func:`rewrite_tests` rewrites every ``assert`` of the tests. Each operand of a comparison, each operand of
  ``not`` / ``and`` / ``or`` and any other asserted expression becomes a *leaf*: the child checks that its
  value is plain data (exact types ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``,
  and ``list`` / ``tuple`` / ``dict`` / ``set`` / ``frozenset`` of plain data; subclasses are refused),
  reports it serialized, and evaluates the assert on it. ``x is y`` / ``x is not y`` is one leaf (identity
  cannot be faked). Elsewhere in the tests, comparisons, arithmetic and unary operands, ``and`` / ``or``
  operands, the conditions of ``if`` / ``while`` / ``x if c else y`` and the argument of ``abs`` must be
  plain data too (``TypeError`` otherwise): no method of the candidate's objects decides them.
- :func:`make_checker` builds, in the child, the functions the rewritten tests call. Everything they use is
  bound when it is built, before the candidate's code runs, so that patching ``builtins`` or a module cannot
  change them.
- Parent side: :func:`summarize` judges the child's records (Python literals: ``('start', limits)``,
  ``('load', phase, error type, text)``, ``('check', test, site, ((leaf, value), ...))``, ``('end', test,
  error type or None, text)`` and ``('done',)``): a test passes when it reported an end without error and
  every assert it reported holds when :func:`judge_check` re-evaluates it, with the structure the parent
  derives itself from the tests' source (:func:`rewrite_tests`), on the decoded values.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Iterable

MAX_DEPTH = 48
MAX_CHARS = 1 << 20  # serialized size of one assert's values
PREFIX = "__cr_"
_EVAL_OPS: dict[str, Callable[[object, object], object]] = {
    "Eq": operator.eq, "NotEq": operator.ne, "Lt": operator.lt, "LtE": operator.le, "Gt": operator.gt,
    "GtE": operator.ge, "In": lambda a, b: a in b, "NotIn": lambda a, b: a not in b, "Is": operator.is_,
    "IsNot": operator.is_not,
}  # fmt: skip


def test_names(tests: str) -> list[str]:
    """Names of the top-level ``test_*`` functions of ``tests`` (raises ``SyntaxError``)."""
    return [n.name for n in ast.parse(tests, "tests.py").body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")]


# ---------------------------------------------------------------------------- rewriting


def _call(name: str, *args: ast.expr) -> ast.Call:
    return ast.Call(func=ast.Name(id=PREFIX + name, ctx=ast.Load()), args=list(args), keywords=[])


def _plain(*nodes: ast.expr) -> list[ast.Call]:
    return [_call("plain__", n) for n in nodes]


def _is_identity(node: ast.Compare) -> bool:
    return len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot))


_PLAIN_FIELDS = {ast.BinOp: ("left", "right"), ast.UnaryOp: ("operand",), ast.BoolOp: ("values",),
                 ast.If: ("test",), ast.While: ("test",), ast.IfExp: ("test",)}  # fmt: skip


class _Rewriter(ast.NodeTransformer):
    """Turns ``assert E, M`` into ``__cr_begin__(k); if not __cr_assert__(k, E'): raise AssertionError(...)``;
    operands elsewhere (``f(x) - want``, ``abs(...)``, ``if`` conditions...) into ``__cr_plain__(...)``."""

    def __init__(self) -> None:
        self.sites: list[object] = []

    def visit_Compare(self, node: ast.Compare) -> ast.expr:
        self.generic_visit(node)
        if not _is_identity(node):
            node.left, *node.comparators = _plain(node.left, *node.comparators)
        return node

    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        for name in _PLAIN_FIELDS.get(type(node), ()):
            value = getattr(node, name)
            setattr(node, name, _plain(*value) if isinstance(value, list) else _plain(value)[0])
        return node

    def visit_Call(self, node: ast.Call) -> ast.expr:
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "abs":
            node.args = _plain(*node.args)
        return node

    def visit_Assert(self, node: ast.Assert) -> list[ast.stmt]:
        k = len(self.sites)  # no assert nests in another's expressions
        shape, expr = self._shape(node.test, k, [0])
        self.sites.append(shape)
        msg_args: list[ast.expr] = [ast.Constant(k), ast.Constant(ast.unparse(node.test)[:300])]
        if node.msg is not None:
            msg_args.append(self.visit(node.msg))
        fail = ast.Raise(exc=ast.Call(ast.Name("AssertionError", ast.Load()), [_call("message__", *msg_args)], []))
        check = ast.UnaryOp(op=ast.Not(), operand=_call("assert__", ast.Constant(k), expr))
        stmts = [ast.Expr(_call("begin__", ast.Constant(k))), ast.If(test=check, body=[fail], orelse=[])]
        return [ast.copy_location(s, node) for s in stmts]

    def _shape(self, e: ast.expr, k: int, n: list[int]) -> tuple[object, ast.expr]:
        """(structure for the parent, rewritten expression) of an asserted expression."""
        if isinstance(e, ast.BoolOp):
            parts = [self._shape(v, k, n) for v in e.values]
            kind = "and" if isinstance(e.op, ast.And) else "or"
            return (kind, tuple(p[0] for p in parts)), ast.BoolOp(op=e.op, values=[p[1] for p in parts])
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            shape, inner = self._shape(e.operand, k, n)
            return ("not", shape), ast.UnaryOp(op=e.op, operand=inner)
        if isinstance(e, ast.Compare) and not _is_identity(e):
            leaves = [self._leaf(x, k, n) for x in (e.left, *e.comparators)]
            expr = ast.Compare(left=leaves[0][1], ops=e.ops, comparators=[leaf[1] for leaf in leaves[1:]])
            return ("cmp", tuple(type(op).__name__ for op in e.ops), tuple(leaf[0] for leaf in leaves)), expr
        return self._leaf(e, k, n)

    def _leaf(self, e: ast.expr, k: int, n: list[int]) -> tuple[object, ast.expr]:
        j = n[0]
        n[0] += 1
        return ("leaf", j), _call("leaf__", ast.Constant(k), ast.Constant(j), self.visit(e))


def rewrite_tests(tests: str) -> tuple[ast.Module, list[object]]:
    """The tests with every ``assert`` rewritten, and one structure per assert site (raises ``SyntaxError``)."""
    rw = _Rewriter()
    tree = ast.fix_missing_locations(rw.visit(ast.parse(tests, "tests.py")))
    return tree, rw.sites


# ---------------------------------------------------------------------------- child side


def make_encoder() -> Callable[[object], str]:
    """``encode(value) -> str``: a plain value as a tagged Python literal (``('i', 3)``, ``('l', (...))``).

    Raises ``TypeError`` for anything but plain data (exact types only), ``ValueError`` past 1 MiB
    or 48 levels. Every builtin it uses is bound when this is called (call it before candidate code
    runs): the nested functions look up no global name, so patching ``builtins`` changes nothing.
    """
    _type, _len, _str_join, _dict_items = type, len, str.join, dict.items
    _int_repr, _float_repr, _str_repr, _bytes_repr = int.__repr__, float.__repr__, str.__repr__, bytes.__repr__
    _TypeError, _ValueError = TypeError, ValueError
    _name_of = type.__dict__["__name__"].__get__  # bypasses a metaclass's __getattribute__
    _bool, _int, _float, _complex, _str, _bytes = bool, int, float, complex, str, bytes
    _list, _tuple, _dict, _set, _frozenset, _NoneType = list, tuple, dict, set, frozenset, type(None)
    _seq_tags = ((_list, "l"), (_tuple, "t"), (_set, "S"), (_frozenset, "F"))
    _max_depth, _max_chars = MAX_DEPTH, MAX_CHARS

    def seq(items: list) -> str:
        return "(" + _str_join(",", items) + ("," if items else "") + ")"

    def enc(v: object, depth: int, budget: list) -> str:
        if depth > _max_depth:
            raise _ValueError("a value checked by an assert is nested too deeply (over 48 levels)")
        t = _type(v)
        if t is _NoneType:
            out = "('n',)"
        elif t is _bool:
            out = "('b',True)" if v else "('b',False)"
        elif t is _int:
            try:
                out = "('i'," + _int_repr(v) + ")"
            except _ValueError:
                raise _ValueError("an integer checked by an assert has too many digits") from None
        elif t is _float:
            out = "('f'," + _str_repr(_float_repr(v)) + ")"
        elif t is _complex:
            out = "('c'," + _str_repr(_float_repr(v.real)) + "," + _str_repr(_float_repr(v.imag)) + ")"
        elif t is _str:
            out = "('s'," + _str_repr(v) + ")"
        elif t is _bytes:
            out = "('y'," + _bytes_repr(v) + ")"
        elif t is _dict:
            pairs = [seq([enc(a, depth + 1, budget), enc(b, depth + 1, budget)]) for a, b in _dict_items(v)]
            out = "('d'," + seq(pairs) + ")"
        else:
            tag = None
            for typ, name in _seq_tags:
                if t is typ:
                    tag = name
            if tag is None:
                raise _TypeError(
                    f"an assert checks a value of type {_name_of(t)!s}; tests compare plain data only (None, "
                    "bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset; no subclasses)"
                )
            out = "('" + tag + "'," + seq([enc(x, depth + 1, budget) for x in v]) + ")"
        budget[0] -= _len(out)
        if budget[0] < 0:
            raise _ValueError("the values checked by one assert are over 1 MiB once serialized")
        return out

    def encode(v: object) -> str:
        return enc(v, 0, [_max_chars])

    return encode


def make_checker() -> tuple[dict[str, Callable], Callable[[], object]]:
    """The functions the rewritten tests call (``__cr_*__``), and ``take()`` for the runner.

    The helpers hold no means of reporting: each executed assert appends ``(site, ((leaf, value),
    ...))`` to a buffer that ``take()`` hands over (and empties). The runner serializes it itself,
    with :func:`make_flusher`, after the test returns. Candidate code that reaches these helpers
    (through a callback's ``__globals__``, say) can add checks, which never makes a test pass.
    """
    encode, _bool, _tuple, _repr, _str_join = make_encoder(), bool, tuple, repr, str.join
    state = {"checks": [], "values": []}

    def plain(v: object) -> object:
        encode(v)
        return v

    def begin(k: int) -> None:
        state["values"] = []

    def leaf(k: int, j: int, v: object) -> object:
        encode(v)
        state["values"].append((j, v))
        return v

    def check(k: int, v: object) -> bool:
        encode(v)  # the result of operations on plain data is plain
        state["checks"].append((k, _tuple(state["values"])))
        return _bool(v)

    def message(k: int, source: str, msg: object = None) -> object:
        if msg is not None:
            return msg
        return source + " (values: " + _str_join(", ", [_repr(v)[:200] for _, v in state["values"]]) + ")"

    def take() -> object:
        out, state["checks"] = state["checks"], []
        return out

    helpers = {"plain__": plain, "begin__": begin, "leaf__": leaf, "assert__": check, "message__": message}
    return {PREFIX + name: fn for name, fn in helpers.items()}, take


def make_flusher(emit: Callable[[str], None], take: Callable[[], object]) -> Callable[[str], None]:
    """``flush(test)``: emit ``('check', test, site, ((leaf, value), ...))`` for each buffered assert.

    Validates what ``take()`` returns with exact-type checks and serializes the values with an
    encoder of its own, so a tampered buffer yields a check that fails (site ``-1``), never a
    record of the candidate's making.
    """
    encode, _type, _len, _str_join = make_encoder(), type, len, str.join
    _int, _tuple, _list, _int_repr, _str_repr = int, tuple, list, int.__repr__, str.__repr__
    _BaseException, _ValueError = BaseException, ValueError

    def one(name: str, entry: object) -> str:
        if _type(entry) is not _tuple or _len(entry) != 2 or _type(entry[0]) is not _int or _type(entry[1]) is not _tuple:
            raise _ValueError
        parts = []
        for pair in entry[1]:
            if _type(pair) is not _tuple or _len(pair) != 2 or _type(pair[0]) is not _int:
                raise _ValueError
            parts.append("(" + _int_repr(pair[0]) + "," + encode(pair[1]) + ")")
        body = "(" + _str_join(",", parts) + ("," if parts else "") + ")"
        return "('check'," + _str_repr(name) + "," + _int_repr(entry[0]) + "," + body + ")"

    def flush(name: str) -> None:
        failed = "('check'," + _str_repr(name) + ",-1,())"
        try:
            entries = take()
            if _type(entries) is not _list:
                raise _ValueError
            for entry in entries:
                try:
                    emit(one(name, entry))
                except _BaseException:  # noqa: BLE001 - tampered: a check the parent judges false
                    emit(failed)
        except _BaseException:  # noqa: BLE001
            emit(failed)

    return flush


# ---------------------------------------------------------------------------- parent side


def summarize(records: list[tuple], names: list[str], sites: list, raw: dict, timeout_s: float) -> dict:
    """The :class:`~composer_replication.rollout.sandbox.SandboxResult` fields judged from ``records``.

    ``names`` and ``sites`` come from the parent's own parse of the tests; ``raw`` holds
    ``returncode``, ``timed_out``, ``duration``, ``stdout`` and ``stderr`` of the run.
    """
    start = next((r for r in records if r[0] == "start" and len(r) == 2), ("start", ()))
    load = next((r for r in records if r[0] == "load" and len(r) == 4), None)
    done = any(r[0] == "done" for r in records)
    by_test: dict[tuple[str, str], list] = {}
    for r in records:
        if r[0] in ("end", "check") and len(r) == 4 and r[1] in names:
            by_test.setdefault((r[0], r[1]), []).append(r)
    results, failures = {}, []  # failures: (error type, text) of each failed test, in order
    for name in (n for n in names if ("end", n) in by_test):
        failed = next((e for e in by_test["end", name] if e[2] is not None), None)
        bad = None if failed else next((c for c in by_test.get(("check", name), []) if not _holds(c, sites)), None)
        results[name] = failed is None and bad is None
        if failed or bad:
            failures.append((str(failed[2]), str(failed[3])) if failed else ("AssertionError",
                            f"{name}: assert #{bad[2]} does not hold on the values the child reported"))
    rc, error, error_type = raw["returncode"], None, None
    if raw["timed_out"]:
        error, error_type = f"timed out after {timeout_s:g}s (sandbox killed)", "Timeout"
    elif load is not None:
        error, error_type = str(load[3]), str(load[2])
    elif failures:
        error_type, error = failures[0]
    elif not done:
        tail = raw["stderr"].strip()[-800:]
        error = f"the run ended without reporting results (exit status {rc})" + (f": {tail}" if tail else "")
        error_type = "NoResult"
    n_passed = sum(results.values())
    return dict(
        passed=done and not raw["timed_out"] and bool(names) and n_passed == len(names), n_passed=n_passed,
        n_total=len(names), stdout=raw["stdout"], stderr=raw["stderr"], timed_out=raw["timed_out"],
        killed=rc is not None and rc < 0, returncode=rc, error=error, error_type=error_type,
        test_results=results, duration_s=raw["duration"],
        limits_applied=[str(x) for x in start[1]] if isinstance(start[1], tuple) else [],
    )  # fmt: skip


def _holds(record: tuple, sites: list) -> bool:
    _, _, k, leaves = record
    return isinstance(k, int) and 0 <= k < len(sites) and isinstance(leaves, tuple) and judge_check(sites[k], leaves)


def decode(v: object, depth: int = 0) -> object:
    """A value serialized by the child's ``enc``, decoded into the same plain value (raises ``ValueError``)."""
    if depth > MAX_DEPTH + 2 or not isinstance(v, tuple) or not v or not isinstance(v[0], str):
        raise ValueError(f"malformed value {str(v)[:80]!r}")
    tag, rest = v[0], v[1:]
    if tag == "n":
        return None
    if tag in ("b", "i", "s", "y") and len(rest) == 1:
        if type(rest[0]) is not {"b": bool, "i": int, "s": str, "y": bytes}[tag]:
            raise ValueError(f"malformed {tag!r} value")
        return rest[0]
    if tag == "f" and len(rest) == 1:
        return float(rest[0])
    if tag == "c" and len(rest) == 2:
        return complex(float(rest[0]), float(rest[1]))
    if tag == "d" and len(rest) == 1:
        return {decode(a, depth + 1): decode(b, depth + 1) for a, b in rest[0]}
    if tag in ("l", "t", "S", "F") and len(rest) == 1:
        return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](decode(x, depth + 1) for x in rest[0])
    raise ValueError(f"unknown value tag {tag!r}")


def _evaluate(shape: object, leaves: dict[int, object]) -> object:
    kind = shape[0]
    if kind == "leaf":
        return leaves[shape[1]]  # KeyError: not reported (the child short-circuited differently)
    if kind == "not":
        return not _evaluate(shape[1], leaves)
    if kind in ("and", "or"):
        value: object = None
        for part in shape[1]:
            value = _evaluate(part, leaves)
            if bool(value) != (kind == "and"):
                return value
        return value
    _, ops, operands = shape
    left = _evaluate(operands[0], leaves)
    for op, operand in zip(ops, operands[1:]):
        right = _evaluate(operand, leaves)
        if not _EVAL_OPS[op](left, right):
            return False
        left = right
    return True


def judge_check(shape: object, leaves: Iterable[tuple[int, object]]) -> bool:
    """True when the assert of structure ``shape`` holds on the reported (serialized) leaf values."""
    try:
        return bool(_evaluate(shape, {int(j): decode(v) for j, v in leaves}))
    except Exception:  # noqa: BLE001 - malformed, missing or incomparable values: the assert does not hold
        return False
