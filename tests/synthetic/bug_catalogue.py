"""The bug catalogue of the synthetic sessions (``generate.py`` beside this file), as data.

Each *family* is one kind of small Python bug with a fixed code shape (a missing default, floor division, a
strict comparison, a mutable default...); its *variants* fill the shape with different names and values, so
two sessions of one family share the pattern of the fix but none of its strings. A :class:`Bug` holds the
buggy module, the fixed module (:attr:`Bug.fixed`), the text the fix replaces and its tests; the session that
fixes it adds the repository layout, the test command and the recorded actions (``generate.Session.task``).
Every bug is written by hand for this project; nothing is copied from real code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Bug", "FAMILIES", "make_bug"]


@dataclass(kw_only=True)
class Bug:
    """One buggy function in one small repository, with its fix and its failing test."""

    family: str
    fn: str
    source: list[str]
    """The buggy module, one string per line."""
    old: str
    """The text the fix replaces (occurs once in ``source``)."""
    new: str
    """The replacement text."""
    tests: list[tuple[str, list[str]]]
    """``(test name, body lines)`` of the module's test file; the first one fails before the fix."""
    error: list[str]
    """The ``E   `` lines pytest prints for the failing test."""
    raises_in_module: bool
    """The failure is an exception raised inside the module (pytest shows the module frame)."""
    symptom: str
    """What the user sees, in one sentence (used in the prompt)."""
    cause: str
    """Why it fails, in one sentence (the agent's diagnosis)."""
    fix: str
    """What the fix does, in a short phrase (the agent's report)."""
    imports: list[str] = field(default_factory=list)
    """Extra imports of the test file."""

    @property
    def buggy(self) -> str:
        """The buggy module's text."""
        return "\n".join(self.source)

    @property
    def fixed(self) -> str:
        """The module's text after the fix."""
        return self.buggy.replace(self.old, self.new)


# ---------------------------------------------------------------------------- the families
# Each family: (variants, builder). A builder gets one variant tuple and returns a Bug (module and
# test paths are chosen by the session, not here).


def _missing_default(v: tuple) -> Bug:
    noun, key, default, other = v
    src = ["import json", "", "", f"def load_{noun}(path):", "    with open(path) as f:",
           "        data = json.load(f)", f'    {key} = data["{key}"]', f'    {other} = data.get("{other}")',
           f'    return {{"{key}": {key}, "{other}": {other}}}', ""]
    body = [f'    p = tmp_path / "{noun}.json"', f"    p.write_text('{{\"{other}\": null}}')",
            f'    assert load_{noun}(p)["{key}"] == {default}']
    ok = [f'    p = tmp_path / "{noun}.json"', f"    p.write_text('{{\"{key}\": 7}}')",
          f'    assert load_{noun}(p)["{key}"] == 7']
    return Bug(family="missing_default", fn=f"load_{noun}", source=src, old=f'    {key} = data["{key}"]',
               new=f'    {key} = data.get("{key}", {default})',
               tests=[(f"test_{key}_defaults", body), (f"test_{key}_is_read", ok)],
               error=[f"E   KeyError: '{key}'"], raises_in_module=True,
               symptom=f"loading a {noun} file without a `{key}` key crashes with KeyError; it should default to {default}",
               cause=f"`load_{noun}` indexes `data[\"{key}\"]` directly, so a file without the key raises KeyError",
               fix=f"`{key}` now defaults to {default} when the file leaves it out")


def _floor_pages(v: tuple) -> Bug:
    fn, size, n, want = v
    src = [f'"""Split a list into groups of at most {size} items."""', "", "",
           f"def {fn}(items, {size}):", f"    count = len(items) // {size}",
           f"    return [items[i * {size}:(i + 1) * {size}] for i in range(count)]", ""]
    got = n // 3
    return Bug(family="floor_pages", fn=fn, source=src, old=f"    count = len(items) // {size}",
               new=f"    count = -(-len(items) // {size})  # ceiling: keep a partial last group",
               tests=[(f"test_{fn}_partial_last", [f"    assert len({fn}(list(range({n})), 3)) == {want}"]),
                      (f"test_{fn}_exact", [f"    assert {fn}([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]"])],
               error=[f"E       assert {got} == {want}", f"E        +  where {got} = len({fn}(list(range({n})), 3))"],
               raises_in_module=False,
               symptom=f"`{fn}(list(range({n})), 3)` gives {got} groups instead of {want}: the last items go missing",
               cause="the group count uses floor division, so a partial last group is dropped",
               fix="the count now uses ceiling division, so a partial last group is kept")


def _strict_limit(v: tuple) -> Bug:
    fn, arg, limit = v
    src = ["", f"MAX_{arg.upper()} = {limit}", "", "",
           f"def {fn}({arg}, limit=MAX_{arg.upper()}):", f'    """True while {arg} has not gone past the limit."""',
           f"    return {arg} < limit", ""]
    return Bug(family="strict_limit", fn=fn, source=src, old=f"    return {arg} < limit",
               new=f"    return {arg} <= limit",
               tests=[(f"test_{fn}_at_limit", [f"    assert {fn}({limit}) is True"]),
                      (f"test_{fn}_over_limit", [f"    assert {fn}({limit + 1}) is False"])],
               error=["E       assert False is True", f"E        +  where False = {fn}({limit})"],
               raises_in_module=False,
               symptom=f"`{fn}({limit})` returns False, but the limit of {limit} should still be allowed",
               cause=f"the check uses `<`, so a value equal to the limit ({limit}) is rejected",
               fix=f"the comparison is now `<=`, so exactly {limit} is allowed")


def _mutable_default(v: tuple) -> Bug:
    fn, item, coll = v
    src = [f"def {fn}({item}, {coll}=[]):", f"    {coll}.append({item})", f"    return {coll}", ""]
    return Bug(family="mutable_default", fn=fn, source=src, old=f"def {fn}({item}, {coll}=[]):\n    {coll}.append",
               new=f"def {fn}({item}, {coll}=None):\n    if {coll} is None:\n        {coll} = []\n    {coll}.append",
               tests=[(f"test_{fn}_fresh_list", [f'    {fn}("a")', f'    assert {fn}("b") == ["b"]']),
                      (f"test_{fn}_given_list", [f'    assert {fn}("b", ["a"]) == ["a", "b"]'])],
               error=["E       AssertionError: assert ['a', 'b'] == ['b']"], raises_in_module=False,
               symptom=f"`{fn}` keeps {coll} from earlier calls: the second call returns the first call's {item} too",
               cause=f"`{coll}=[]` is evaluated once, so every call without `{coll}` appends to the same list",
               fix=f"`{coll}` now defaults to None and a new list is made per call")


def _none_input(v: tuple) -> Bug:
    fn, arg, op = v
    src = [f"def {fn}({arg}):", f'    """{arg.capitalize()}, normalized for comparison."""',
           f"    return {arg}.strip(){op}", ""]
    return Bug(family="none_input", fn=fn, source=src, old=f"    return {arg}.strip(){op}",
               new=f'    if {arg} is None:\n        return ""\n    return {arg}.strip(){op}',
               tests=[(f"test_{fn}_none", [f'    assert {fn}(None) == ""']),
                      (f"test_{fn}_spaces", [f'    assert {fn}("  x ") == "{"X" if op in (".title()", ".upper()") else "x"}"'])],
               error=["E   AttributeError: 'NoneType' object has no attribute 'strip'"], raises_in_module=True,
               symptom=f"`{fn}(None)` crashes with AttributeError; records without a {arg} should give an empty string",
               cause=f"`{fn}` calls `.strip()` on `{arg}` without checking for None",
               fix=f'`{fn}(None)` now returns ""')


def _int_mean(v: tuple) -> Bug:
    fn, coll = v
    src = [f"def {fn}({coll}):", f"    if not {coll}:", "        return 0.0", f"    return sum({coll}) // len({coll})", ""]
    return Bug(family="int_mean", fn=fn, source=src, old=f"    return sum({coll}) // len({coll})",
               new=f"    return sum({coll}) / len({coll})",
               tests=[(f"test_{fn}_fraction", [f"    assert {fn}([1, 2]) == 1.5"]),
                      (f"test_{fn}_empty", [f"    assert {fn}([]) == 0.0"])],
               error=["E       assert 1 == 1.5", f"E        +  where 1 = {fn}([1, 2])"], raises_in_module=False,
               symptom=f"`{fn}([1, 2])` returns 1 instead of 1.5",
               cause="the mean uses floor division `//`, which drops the fraction",
               fix="the mean uses true division")


def _case_compare(v: tuple) -> Bug:
    fn, a, b = v
    src = [f"def {fn}({a}, {b}):", '    """True when both name the same account."""',
           f"    return {a}.strip() == {b}.strip()", ""]
    return Bug(family="case_compare", fn=fn, source=src, old=f"    return {a}.strip() == {b}.strip()",
               new=f"    return {a}.strip().casefold() == {b}.strip().casefold()",
               tests=[(f"test_{fn}_ignores_case", [f'    assert {fn}("Ann@Example.com", "ann@example.com")']),
                      (f"test_{fn}_different", [f'    assert not {fn}("ann@example.com", "bob@example.com")'])],
               error=["E       AssertionError: assert False",
                      f"E        +  where False = {fn}('Ann@Example.com', 'ann@example.com')"],
               raises_in_module=False,
               symptom=f"`{fn}` treats `Ann@Example.com` and `ann@example.com` as different",
               cause="the comparison is case-sensitive", fix="both sides are case-folded before comparing")


def _sort_order(v: tuple) -> Bug:
    fn, coll, key = v
    src = [f"def {fn}({coll}, n=3):", f'    """The n {coll} with the highest {key}."""',
           f'    ranked = sorted({coll}, key=lambda r: r["{key}"])', "    return ranked[:n]", ""]
    return Bug(family="sort_order", fn=fn, source=src, old=f'key=lambda r: r["{key}"])',
               new=f'key=lambda r: r["{key}"], reverse=True)',
               tests=[(f"test_{fn}_highest_first",
                       [f'    rows = [{{"{key}": 1}}, {{"{key}": 5}}, {{"{key}": 3}}]',
                        f'    assert [r["{key}"] for r in {fn}(rows, 2)] == [5, 3]'])],
               error=["E       assert [1, 3] == [5, 3]", "E         At index 0 diff: 1 != 5"], raises_in_module=False,
               symptom=f"`{fn}` returns the {coll} with the lowest {key} instead of the highest",
               cause="`sorted` is ascending by default, so the slice takes the smallest values",
               fix="the sort is descending (`reverse=True`)")


def _split_spaces(v: tuple) -> Bug:
    fn, arg = v
    src = [f"def {fn}({arg}):", f'    """The words of {arg}, lower-cased."""',
           f'    return [w.lower() for w in {arg}.split(" ")]', ""]
    return Bug(family="split_spaces", fn=fn, source=src, old=f'{arg}.split(" ")]', new=f"{arg}.split()]",
               tests=[(f"test_{fn}_double_space", [f'    assert {fn}("Red  Blue") == ["red", "blue"]'])],
               error=["E       AssertionError: assert ['red', '', 'blue'] == ['red', 'blue']"],
               raises_in_module=False,
               symptom=f'`{fn}("Red  Blue")` returns an empty string between the words',
               cause='`split(" ")` yields an empty string for every extra space',
               fix="it splits on any run of whitespace (`split()`)")


def _tail_slice(v: tuple) -> Bug:
    fn, coll = v
    src = [f"def {fn}({coll}, n):", f'    """The last n {coll}, oldest first."""', f"    return {coll}[-n:-1]", ""]
    return Bug(family="tail_slice", fn=fn, source=src, old=f"    return {coll}[-n:-1]", new=f"    return {coll}[-n:]",
               tests=[(f"test_{fn}_includes_newest", [f"    assert {fn}([1, 2, 3, 4], 2) == [3, 4]"])],
               error=["E       assert [3] == [3, 4]", "E         Right contains one more item: 4"],
               raises_in_module=False,
               symptom=f"`{fn}(..., 2)` returns only one item and never the newest",
               cause="the slice `[-n:-1]` stops before the last element", fix="the slice is `[-n:]`")


def _dedupe_order(v: tuple) -> Bug:
    fn, coll = v
    src = [f"def {fn}({coll}):", f'    """{coll.capitalize()} without repeats, in first-seen order."""',
           f"    return list(set({coll}))", ""]
    return Bug(family="dedupe_order", fn=fn, source=src, old=f"    return list(set({coll}))",
               new=f"    return list(dict.fromkeys({coll}))",
               tests=[(f"test_{fn}_keeps_order", [f'    assert {fn}(["b", "a", "b", "c"]) == ["b", "a", "c"]'])],
               error=["E       AssertionError: assert ['a', 'c', 'b'] == ['b', 'a', 'c']"], raises_in_module=False,
               symptom=f"`{fn}` shuffles the {coll}: the first-seen order is lost",
               cause="`set` does not keep insertion order", fix="it uses `dict.fromkeys`, which keeps the first-seen order")


def _zero_pad(v: tuple) -> Bug:
    fn, unit = v
    src = [f"def {fn}(total_{unit}):", '    """Format a duration as M:SS."""',
           f"    minutes, rest = divmod(total_{unit}, 60)", '    return f"{minutes}:{rest}"', ""]
    return Bug(family="zero_pad", fn=fn, source=src, old='    return f"{minutes}:{rest}"',
               new='    return f"{minutes}:{rest:02d}"',
               tests=[(f"test_{fn}_pads", [f'    assert {fn}(65) == "1:05"'])],
               error=["E       AssertionError: assert '1:5' == '1:05'"], raises_in_module=False,
               symptom=f'`{fn}(65)` prints "1:5" instead of "1:05"',
               cause="the remainder is formatted without zero padding", fix="the remainder is padded to two digits")


FAMILIES: dict[str, tuple[list[tuple], Callable[[tuple], Bug]]] = {
    "missing_default": ([("settings", "timeout", 30, "name"), ("profile", "locale", '"en"', "email"),
                         ("job", "max_retries", 3, "queue"), ("server", "port", 8080, "host"),
                         ("cache", "ttl", 300, "backend"), ("upload", "chunk_size", 1024, "bucket")], _missing_default),
    "floor_pages": ([("paginate", "page_size", 10, 4), ("batch", "batch_size", 7, 3), ("chunk_rows", "chunk", 8, 3),
                     ("split_pages", "per_page", 11, 4), ("group_jobs", "group_size", 5, 2)], _floor_pages),
    "strict_limit": ([("can_retry", "attempts", 3), ("within_quota", "used", 100), ("fits_cart", "count", 20),
                      ("allowed_upload", "size_mb", 50), ("may_login", "failures", 5)], _strict_limit),
    "mutable_default": ([("add_tag", "tag", "tags"), ("queue_job", "job", "pending"), ("log_event", "event", "events"),
                         ("collect_error", "err", "errors"), ("append_row", "row", "rows")], _mutable_default),
    "none_input": ([("clean_name", "name", ".lower()"), ("normalize_email", "email", ".casefold()"),
                    ("norm_title", "title", ".title()"), ("clean_sku", "sku", ".upper()"),
                    ("strip_note", "note", "")], _none_input),
    "int_mean": ([("average", "values"), ("mean_latency", "samples"), ("avg_rating", "ratings"),
                  ("mean_score", "scores"), ("avg_price", "prices")], _int_mean),
    "case_compare": ([("same_email", "a", "b"), ("same_user", "left", "right"), ("emails_match", "given", "stored"),
                      ("is_same_login", "first", "second")], _case_compare),
    "sort_order": ([("top_scores", "players", "score"), ("biggest_orders", "orders", "total"),
                    ("most_viewed", "posts", "views"), ("top_sellers", "products", "sold")], _sort_order),
    "split_spaces": ([("parse_tags", "line"), ("tokenize_query", "query"), ("split_words", "text"),
                      ("keywords", "phrase")], _split_spaces),
    "tail_slice": ([("last_entries", "entries"), ("recent_events", "events"), ("tail_lines", "lines"),
                    ("latest_logs", "logs")], _tail_slice),
    "dedupe_order": ([("unique_tags", "tags"), ("dedupe_emails", "emails"), ("distinct_ids", "ids"),
                      ("unique_paths", "paths")], _dedupe_order),
    "zero_pad": ([("format_duration", "seconds"), ("clock_label", "secs"), ("track_length", "seconds"),
                  ("fmt_elapsed", "secs")], _zero_pad),
}
"""family name -> (variants, builder)."""


def make_bug(family: str, variant: int) -> Bug:
    """The bug of ``FAMILIES[family]``'s ``variant``-th variant.

    Raises:
        KeyError: an unknown family (names the known ones); IndexError: no such variant.
    """
    if family not in FAMILIES:
        raise KeyError(f"unknown bug family {family!r}; known: {sorted(FAMILIES)}")
    variants, build = FAMILIES[family]
    bug = build(variants[variant])
    if bug.buggy.count(bug.old) != 1:
        raise AssertionError(f"{family}[{variant}]: the fix's old text must occur once in the module")
    return bug
