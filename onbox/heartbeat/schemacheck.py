"""heartbeat.schema.json, compiled: a validator of the JSON Schema keywords that file uses (type, const, enum,
pattern, minLength, maxLength, minimum, required, properties, items, oneOf, local $ref), so that the tracker checks
every beat against the documented schema itself without a dependency. A keyword it does not know raises
ValueError when the schema is compiled: a schema change must come with its check (tests/unit checks it agrees with
the `jsonschema` package). schema.py runs it (`schema_problems`).

Each schema node compiles to two functions: a fast predicate (exact JSON types, no messages: what every valid beat
costs) and an explaining check that collects "path: problem" lines, run only when the predicate said no.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

Check = Callable[[Any, str, List[str]], None]
Pred = Callable[[Any], bool]
_ANNOTATIONS = {"$schema", "$id", "$comment", "$defs", "title", "description", "default", "examples"}
_TYPES: Dict[str, Callable[[Any], bool]] = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    # JSON Schema 2020-12: 1.0 is an integer; a bool is never a number
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}
_EXACT = {"null": (type(None),), "boolean": (bool,), "integer": (int,), "number": (int, float), "string": (str,),
          "array": (list,), "object": (dict,)}


def _json_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _describe(schema: Mapping[str, Any]) -> str:
    if "enum" in schema:
        return "/".join(json.dumps(v) for v in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    t = schema.get("type", "any value")
    return " or ".join(t) if isinstance(t, list) else str(t)


def _join(path: str, key: str) -> str:
    return "%s.%s" % (path, key) if path else key


class _Defs:
    """Compiled `$defs`, filled lazily (a definition may refer to itself)."""

    def __init__(self, root: Mapping[str, Any]) -> None:
        self.root = root
        self.done: Dict[str, Tuple[Pred, Check]] = {}

    def get(self, name: str) -> Tuple[Pred, Check]:
        if name not in self.done:
            self.done[name] = (lambda v: True, lambda v, p, e: None)  # placeholder while it compiles
            self.done[name] = _compile(self.root["$defs"][name], self)
        return self.done[name]


def compile_schema(schema: Mapping[str, Any]) -> Tuple[Pred, Check]:
    """(is_valid, explain) for the JSON Schema keywords heartbeat.schema.json uses: type, const, enum, pattern,
    minLength, maxLength, minimum, required, properties, items, oneOf, local $ref. tests/unit checks it agrees
    with the `jsonschema` package. Any other keyword raises ValueError: a schema change must come with its check."""
    return _compile(schema, _Defs(schema))


def _compile(schema: Mapping[str, Any], defs: _Defs) -> Tuple[Pred, Check]:
    parts = [_keyword(key, arg, defs) for key, arg in schema.items() if key not in _ANNOTATIONS]
    preds = tuple(p for p, _ in parts)
    checks = tuple(c for _, c in parts)
    if len(parts) == 1:  # most nodes are one keyword (a leaf's type): no loop around it
        return parts[0]

    def valid(v: Any) -> bool:
        return all(p(v) for p in preds)

    def check(v: Any, path: str, errs: List[str]) -> None:
        for c in checks:
            c(v, path, errs)
    return valid, check


def _keyword(key: str, arg: Any, defs: _Defs) -> Tuple[Pred, Check]:  # one branch per keyword
    if key == "type":
        names = arg if isinstance(arg, list) else [arg]
        tests = tuple(_TYPES[n] for n in names)
        exact = frozenset(t for n in names for t in _EXACT[n])
        integral = "integer" in names and "number" not in names
        want = " or ".join(names)

        def p_type(v: Any) -> bool:
            t = type(v)
            if t in exact:
                return True
            return (integral and t is float and v.is_integer()) or (t not in _EXACT_ALL and any(f(v) for f in tests))

        def c_type(v: Any, path: str, errs: List[str]) -> None:
            if not any(f(v) for f in tests):
                errs.append("%s: must be %s, not %s" % (path or "beat", want, _json_type(v)))
        _settle(p_type, frozenset() if integral else exact)
        return p_type, c_type
    if key in ("const", "enum"):
        allowed = [arg] if key == "const" else list(arg)

        def p_enum(v: Any) -> bool:
            return any(_json_equal(v, a) for a in allowed)

        def c_enum(v: Any, path: str, errs: List[str]) -> None:
            if not p_enum(v):
                errs.append("%s: must be %s" % (path or "beat", "/".join(json.dumps(a) for a in allowed)))
        return p_enum, c_enum
    if key == "pattern":
        rx = re.compile(arg)

        def p_pattern(v: Any) -> bool:
            return not isinstance(v, str) or rx.search(v) is not None

        def c_pattern(v: Any, path: str, errs: List[str]) -> None:
            if not p_pattern(v):
                errs.append("%s: does not match %s" % (path or "beat", arg))
        return p_pattern, c_pattern
    if key in ("minLength", "maxLength"):
        n, longest = int(arg), key == "maxLength"

        def p_len(v: Any) -> bool:
            return not isinstance(v, str) or (len(v) <= n if longest else len(v) >= n)

        def c_len(v: Any, path: str, errs: List[str]) -> None:
            if not p_len(v):
                errs.append("%s: must be %s %d characters" % (path or "beat", "at most" if longest else "at least", n))
        return p_len, c_len
    if key == "minimum":
        def p_min(v: Any) -> bool:
            return not isinstance(v, (int, float)) or isinstance(v, bool) or v >= arg

        def c_min(v: Any, path: str, errs: List[str]) -> None:
            if not p_min(v):
                errs.append("%s: must be >= %s" % (path or "beat", arg))
        return p_min, c_min
    if key == "required":
        required = tuple(arg)

        def p_required(v: Any) -> bool:
            return not isinstance(v, dict) or all(name in v for name in required)

        def c_required(v: Any, path: str, errs: List[str]) -> None:
            if isinstance(v, dict):
                errs.extend("%s: required" % _join(path, name) for name in required if name not in v)
        return p_required, c_required
    if key == "properties":
        props = [(k, _compile(sub, defs)) for k, sub in arg.items()]
        fast = tuple((k, p) for k, (p, _) in props)

        def p_props(v: Any) -> bool:
            if isinstance(v, dict):
                get = v.get
                for name, p in fast:
                    x = get(name, _ABSENT)
                    if x is not _ABSENT and not p(x):
                        return False
            return True

        def c_props(v: Any, path: str, errs: List[str]) -> None:
            if isinstance(v, dict):
                for name, (_, c) in props:
                    if name in v:
                        c(v[name], _join(path, name), errs)
        return p_props, c_props
    if key == "items":
        p_item, c_item = _compile(arg, defs)

        column = _column_rule(arg)

        def p_items(v: Any) -> bool:
            if not isinstance(v, list):
                return True
            fast = _settled(p_item)  # a column of numbers (the points): its types, at C speed
            if fast is not None and set(map(type, v)) <= fast:
                return True
            if column is not None and set(map(type, v)) <= column[0]:
                low = min((x for x in v if x is not None), default=None)
                if low is None or column[1] is None or low >= column[1]:
                    return True
            return all(p_item(x) for x in v)

        def c_items(v: Any, path: str, errs: List[str]) -> None:
            if isinstance(v, list):
                for i, x in enumerate(v):
                    c_item(x, "%s[%d]" % (path, i), errs)
        return p_items, c_items
    if key == "oneOf":
        subs = tuple(_compile(sub, defs)[0] for sub in arg)
        want = " | ".join(_describe(sub) for sub in arg)
        settled = _one_branch_types(arg)

        def p_one(v: Any) -> bool:
            if type(v) in settled:  # a metric's number or null (the points' columns): no branch to try
                return True
            return sum(1 for p in subs if p(v)) == 1

        def c_one(v: Any, path: str, errs: List[str]) -> None:
            if not p_one(v):
                errs.append("%s: must be exactly one of %s" % (path or "beat", want))
        _settle(p_one, settled)
        return p_one, c_one
    if key == "$ref":
        if not isinstance(arg, str) or not arg.startswith("#/$defs/"):
            raise ValueError("heartbeat schema: only local #/$defs/ references are supported, not %r" % arg)
        name = arg[len("#/$defs/"):]
        defs.get(name)  # compile now: a bad definition fails at load

        def p_ref(v: Any) -> bool:
            return defs.done[name][0](v)

        def c_ref(v: Any, path: str, errs: List[str]) -> None:
            defs.done[name][1](v, path, errs)
        target = _settled(defs.done[name][0])  # (a definition still compiling, which refers to itself: none)
        if target is not None:
            _settle(p_ref, target)
        return p_ref, c_ref
    raise ValueError("heartbeat schema keyword %r is not supported by onbox.heartbeat.schemacheck.compile_schema: "
                     "add its check there" % key)


_ABSENT = object()


def _settle(pred: Any, types: frozenset) -> None:
    """Mark a predicate with the Python types whose every value it accepts (only where that is all it checks): an
    array of them is then checked by its set of types alone (`_settled`)."""
    if types:
        pred._onbox_settled = types


def _settled(pred: Any) -> Optional[frozenset]:
    return getattr(pred, "_onbox_settled", None)


def _column_rule(schema: Any) -> Optional[Tuple[frozenset, Any]]:
    """(the exact Python types, the minimum or None) of an item schema that is only a `type` and a `minimum`
    (the points' steps: integer or null, >= 0), so that a whole array of them is checked at C speed."""
    if not isinstance(schema, dict) or "type" not in schema or set(schema) - {"type", "minimum"}:
        return None
    names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    if not set(names) <= {"integer", "number", "null"}:
        return None
    return frozenset(t for n in names for t in _EXACT[n]), schema.get("minimum")


def _one_branch_types(branches: List[Any]) -> frozenset:
    """The Python types whose every value matches exactly one of a oneOf's branches, read off branches that are a
    lone `type` or `enum` (any other branch: none). {"type": "number"} | {"type": "null"} | {"enum": [strings]}
    gives int, float and NoneType: such a value is valid without trying the branches."""
    counts: Dict[Any, int] = {}
    partly: Set[Any] = set()  # types an enum takes some values of: it depends on the value
    for b in branches:
        if not isinstance(b, dict) or len(b) != 1 or not ({"type", "enum"} & set(b)):
            return frozenset()
        if "enum" in b:
            partly.update(type(x) for x in b["enum"])
            continue
        names = b["type"] if isinstance(b["type"], list) else [b["type"]]
        if "integer" in names and "number" not in names:
            return frozenset()  # 1.0 is an integer, 1.5 is not: it depends on the value
        for t in {t for n in names for t in _EXACT[n]}:
            counts[t] = counts.get(t, 0) + 1
    return frozenset(t for t, n in counts.items() if n == 1 and t not in partly and t is not bool)


_EXACT_ALL = frozenset(t for ts in _EXACT.values() for t in ts)


def _json_type(v: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _TYPES[name](v):
            return name
    return type(v).__name__
