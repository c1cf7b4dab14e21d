"""The tracker's compiled heartbeat-schema check agrees with the `jsonschema` package on heartbeat.schema.json,
refuses keywords it does not implement, and the strict JSON parser refuses what JSON cannot carry."""
from __future__ import annotations

import copy
import json
import os

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onbox.heartbeat.schema import compile_schema, load_schema, loads_strict, schema_problems, validate
from tests.conftest import REPO_ROOT

GOLDEN = os.path.join(REPO_ROOT, "tests", "golden", "heartbeat", "heartbeat.json")
REFERENCE = jsonschema.Draft202012Validator(load_schema())


def golden():
    with open(GOLDEN) as f:
        return json.load(f)


def paths(doc, prefix=()):
    """Every (path) in a document, containers included."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from paths(v, (*prefix, i))


SECTION_PATHS = [p for p in paths(golden()) if p] + [("slurm",), ("preemption",), ("gpus", "gpus", 0, "verdict")]

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.integers(-2**60, 2**60),
                      st.sampled_from([-1, 0, 1.0, -0.5, 2.5, 1e300]), st.floats(allow_nan=False, allow_infinity=False),
                      st.sampled_from(["", "x", "NaN", "Infinity", "-Infinity", "warning", "critical", "interval",
                                       "onbox.heartbeat/1", "v2"]))
json_value = st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(
    st.sampled_from(["code", "pid", "alive", "gpus", "index", "x", "job_id"]), c, max_size=3), max_leaves=8)


def put(doc, path, value):
    cur = doc
    for part in path[:-1]:
        if isinstance(cur, dict):
            cur = cur.setdefault(part, {})
        elif isinstance(cur, list) and isinstance(part, int) and part < len(cur):
            cur = cur[part]
        else:
            return doc
    if isinstance(cur, dict) or (isinstance(cur, list) and isinstance(path[-1], int) and path[-1] < len(cur)):
        cur[path[-1]] = value
    return doc


EDGE_VALUES = [None, True, False, -1, 0, 1, 1.0, -0.5, 2.5, "", "x", "NaN", "warning", [], [1], {}, {"code": "c"},
               [{"code": "c"}], [{"x": 1}]]


def test_compiled_check_agrees_with_jsonschema_on_every_path_and_edge_value():
    disagree = []
    for path in SECTION_PATHS:
        for value in EDGE_VALUES:
            doc = put(copy.deepcopy(golden()), path, copy.deepcopy(value))
            if (schema_problems(doc) == []) != REFERENCE.is_valid(doc):
                disagree.append((path, value))
    assert disagree == []


@settings(max_examples=300, deadline=None)
@given(edits=st.lists(st.tuples(st.sampled_from(SECTION_PATHS), json_value), min_size=1, max_size=3))
def test_compiled_check_agrees_with_jsonschema(edits):
    doc = copy.deepcopy(golden())
    for path, value in edits:
        put(doc, path, value)
    assert (schema_problems(doc) == []) == REFERENCE.is_valid(doc), (edits, schema_problems(doc))


@pytest.mark.parametrize("section,value,where", [
    ("gpus", {"available": True, "gpus": [{"temperature_c": "hot"}]}, "gpus.gpus[0].temperature_c"),
    ("gpus", {"available": "yes"}, "gpus.available"),
    ("host", {"oom_kill": 1.5}, "host.oom_kill"),
    ("child", {"alive": 1}, "child.alive"),
    ("disks", [{"free_bytes": "lots"}], "disks[0].free_bytes"),
    ("alerts", [{"code": "x", "severity": "meh"}], "alerts[0].severity"),
    ("alerts", [{"severity": "warning"}], "alerts[0].code"),
    ("spool", {"backlog": "1"}, "spool.backlog"),
    ("slurm", {"restart_count": -1}, "slurm.restart_count"),
    ("checkpoint", {"last_sync": "yesterday"}, "checkpoint.last_sync"),
    ("progress", {"loss": "lots"}, "progress.loss"),
    ("reason", "because", "reason"),
])
def test_every_section_is_checked_and_named(section, value, where):
    doc = dict(golden(), **{section: value})
    problems = validate(doc)
    assert problems and any(where in p for p in problems), problems
    assert not REFERENCE.is_valid(doc)


def test_non_finite_numbers_anywhere_are_refused_with_their_place():
    assert validate(dict(golden(), gpus={"temp": float("inf")})) == [
        "gpus.temp: a number that is not finite (inf) is not JSON"]
    assert "alerts[0].data.z" in validate(dict(golden(), alerts=[{"code": "c", "data": {"z": float("nan")}}]))[0]
    assert validate(golden()) == []


@pytest.mark.parametrize("text", ['{"a": 1e400}', '{"a": -1e999}', '{"a": NaN}', '{"a": Infinity}',
                                  '{"a": [1, -Infinity]}'])
def test_strict_parser_refuses_what_json_cannot_carry(text):
    with pytest.raises(ValueError):
        loads_strict(text)


def test_strict_parser_keeps_ordinary_numbers():
    assert loads_strict('{"a": 1e308, "b": -2.5e-300, "c": 12345678901234567890}') == {
        "a": 1e308, "b": -2.5e-300, "c": 12345678901234567890}


def test_an_unsupported_keyword_fails_loudly():
    with pytest.raises(ValueError, match="additionalProperties"):
        compile_schema({"type": "object", "additionalProperties": False})
    with pytest.raises(ValueError, match="local"):
        compile_schema({"$ref": "https://example.com/other.json"})
