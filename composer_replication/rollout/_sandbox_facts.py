"""Facts of a test run that the parent judges (stdlib only: imported by the parent and by the sandbox child).

A test passes when the *parent* says so, from plain data the child reported, so that no object of
the candidate's can vote on its own result (an ``__eq__`` that always returns ``True``, say).

- :func:`rewrite_tests` rewrites every ``assert`` of the tests. Each operand of a comparison, each
  operand of ``not`` / ``and`` / ``or`` and any other asserted expression becomes a *leaf*: the child
  checks that its value is plain data (exact types ``None``, ``bool``, ``int``, ``float``,
  ``complex``, ``str``, ``bytes``, and ``list`` / ``tuple`` / ``dict`` / ``set`` / ``frozenset`` of
  plain data; subclasses are refused), reports it serialized, and evaluates the assert on it.
  ``x is y`` / ``x is not y`` is one leaf (identity cannot be faked). Elsewhere in the tests,
  comparisons, arithmetic and unary operands, ``and`` / ``or`` operands, the conditions of ``if`` /
  ``while`` / ``x if c else y`` and the argument of ``abs`` must be plain data too (``TypeError``
  otherwise): no method of the candidate's objects decides them.
- :func:`make_checker` builds, in the child, the functions the rewritten tests call. Everything
  they use is bound when it is built, before the candidate's code runs, so that patching
  ``builtins`` or a module cannot change them.
- :mod:`._sandbox_score` (parent side) re-evaluates each reported assert with the structure the
  parent derives itself from the tests' source (:func:`rewrite_tests`), on the decoded values.
"""

from __future__ import annotations

import ast
from collections.abc import Callable

MAX_DEPTH = 48
MAX_CHARS = 1 << 20  # serialized size of one assert's values
PREFIX = "__cr_"
_OPS = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
}


def test_names(tests: str) -> list[str]:
    """Names of the top-level ``test_*`` functions of ``tests`` (raises ``SyntaxError``)."""
    return [
        n.name
        for n in ast.parse(tests, "tests.py").body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")
    ]


# ---------------------------------------------------------------------------- rewriting


def _call(name: str, *args: ast.expr) -> ast.Call:
    return ast.Call(func=ast.Name(id=PREFIX + name, ctx=ast.Load()), args=list(args), keywords=[])


class _Rewriter(ast.NodeTransformer):
    """Turns ``assert E, M`` into ``__cr_begin__(k); if not __cr_assert__(k, E'): raise AssertionError(...)``."""

    def __init__(self) -> None:
        self.sites: list[object] = []

    def visit_Compare(self, node: ast.Compare) -> ast.expr:
        self.generic_visit(node)
        if len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot)):
            return node
        node.left = _call("plain__", node.left)
        node.comparators = [_call("plain__", c) for c in node.comparators]
        return node

    def visit_BinOp(
        self, node: ast.BinOp
    ) -> ast.expr:  # `f(x) - want` cannot be an object whose __sub__ lies
        self.generic_visit(node)
        node.left, node.right = _call("plain__", node.left), _call("plain__", node.right)
        return node

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.expr:
        self.generic_visit(node)
        node.operand = _call("plain__", node.operand)
        return node

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.expr:
        self.generic_visit(node)
        node.values = [_call("plain__", v) for v in node.values]
        return node

    def _plain_test(self, node: ast.If | ast.While | ast.IfExp) -> ast.AST:  # no __bool__ decides a branch
        self.generic_visit(node)
        node.test = _call("plain__", node.test)
        return node

    visit_If = visit_While = visit_IfExp = _plain_test

    def visit_Call(
        self, node: ast.Call
    ) -> ast.expr:  # abs(f(x)) < tol cannot be an object whose __abs__ lies
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "abs":
            node.args = [_call("plain__", a) for a in node.args]
        return node

    def visit_Assert(self, node: ast.Assert) -> list[ast.stmt]:
        k = len(self.sites)
        self.sites.append(None)
        n_leaves = [0]
        shape, expr = self._shape(node.test, k, n_leaves)
        self.sites[k] = shape
        msg_args: list[ast.expr] = [ast.Constant(k), ast.Constant(ast.unparse(node.test)[:300])]
        if node.msg is not None:
            msg_args.append(self.visit(node.msg))
        stmts = [
            ast.Expr(_call("begin__", ast.Constant(k))),
            ast.If(
                test=ast.UnaryOp(op=ast.Not(), operand=_call("assert__", ast.Constant(k), expr)),
                body=[
                    ast.Raise(
                        exc=ast.Call(
                            func=ast.Name(id="AssertionError", ctx=ast.Load()),
                            args=[_call("message__", *msg_args)],
                            keywords=[],
                        ),
                        cause=None,
                    )
                ],
                orelse=[],
            ),
        ]
        for s in stmts:
            ast.copy_location(s, node)
        return stmts

    def _shape(self, e: ast.expr, k: int, n: list[int]) -> tuple[object, ast.expr]:
        """(structure for the parent, rewritten expression) of an asserted expression."""
        if isinstance(e, ast.BoolOp):
            parts = [self._shape(v, k, n) for v in e.values]
            kind = "and" if isinstance(e.op, ast.And) else "or"
            return (kind, tuple(p[0] for p in parts)), ast.BoolOp(op=e.op, values=[p[1] for p in parts])
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            shape, inner = self._shape(e.operand, k, n)
            return ("not", shape), ast.UnaryOp(op=e.op, operand=inner)
        if isinstance(e, ast.Compare) and not (len(e.ops) == 1 and isinstance(e.ops[0], (ast.Is, ast.IsNot))):
            leaves = [self._leaf(x, k, n) for x in (e.left, *e.comparators)]
            ops = tuple(_OPS[type(op)] for op in e.ops)
            expr = ast.Compare(left=leaves[0][1], ops=e.ops, comparators=[leaf[1] for leaf in leaves[1:]])
            return ("cmp", ops, tuple(leaf[0] for leaf in leaves)), expr
        return self._leaf(e, k, n)

    def _leaf(self, e: ast.expr, k: int, n: list[int]) -> tuple[object, ast.expr]:
        j = n[0]
        n[0] += 1
        return ("leaf", j), _call("leaf__", ast.Constant(k), ast.Constant(j), self.visit(e))


def rewrite_tests(tests: str) -> tuple[ast.Module, list[object]]:
    """The tests with every ``assert`` rewritten, and one structure per assert site (raises ``SyntaxError``)."""
    tree = ast.parse(tests, "tests.py")
    rw = _Rewriter()
    tree = ast.fix_missing_locations(rw.visit(tree))
    return tree, rw.sites


# ---------------------------------------------------------------------------- child side


def make_encoder() -> Callable[[object], str]:
    """``encode(value) -> str``: a plain value as a tagged Python literal (``('i', 3)``, ``('l', (...))``).

    Raises ``TypeError`` for anything but plain data (exact types only), ``ValueError`` past 1 MiB
    or 48 levels. Every builtin it uses is bound when this is called (call it before candidate code
    runs): the nested functions look up no global name, so patching ``builtins`` changes nothing.
    """
    _type, _len, _str_join, _dict_items = type, len, str.join, dict.items
    _int_repr, _float_repr, _str_repr, _bytes_repr = (
        int.__repr__,
        float.__repr__,
        str.__repr__,
        bytes.__repr__,
    )
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

    helpers = {
        PREFIX + "plain__": plain,
        PREFIX + "begin__": begin,
        PREFIX + "leaf__": leaf,
        PREFIX + "assert__": check,
        PREFIX + "message__": message,
    }
    return helpers, take


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
        if _type(entry) is not _tuple or _len(entry) != 2 or _type(entry[0]) is not _int:
            raise _ValueError
        if _type(entry[1]) is not _tuple:
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
