"""The tracker API against a real `onboxctl tracker serve` process: auth, limits, validation, fuzzing.

Bad input of any shape gets a 4xx with a message, never a 500 (hypothesis drives the fuzzing).
"""
from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.hosts.tracker import TrackerProcess


def beat(seq, run="r1", **extra):
    doc = {"schema": "onbox.heartbeat/1", "run": run, "box": "b", "attempt": 0, "seq": seq, "time": 1.0 + seq,
           "state": "running", "interval_s": 30.0, "progress": {"step": seq, "loss": 2.0}}
    doc.update(extra)
    return doc


@pytest.fixture(scope="module")
def shared_tracker(tmp_path_factory):
    t = TrackerProcess(str(tmp_path_factory.mktemp("tracker")), extra_args=["--max-body", "65536"])
    t.start()
    try:
        yield t
    finally:
        t.stop()


@pytest.mark.integration
def test_auth_required_for_writes_and_reads(shared_tracker):
    t = shared_tracker
    r = requests.post(t.url + "/api/v1/heartbeats", json={"heartbeats": [beat(0)]}, timeout=10)
    assert r.status_code == 401 and "token" in r.json()["error"]
    r = requests.post(t.url + "/api/v1/heartbeats", json={"heartbeats": [beat(0)]},
                      headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
    assert requests.get(t.url + "/api/v1/runs", timeout=10).status_code == 401
    health = requests.get(t.url + "/healthz", timeout=10).json()
    assert health["ok"] is True and "connections" not in health  # open, but the counts are for readers


@pytest.mark.integration
def test_post_list_page_and_dedupe(shared_tracker):
    t = shared_tracker
    r = t.post([beat(i, run="paged") for i in range(5)])
    assert r.status_code == 200 and r.json() == {"accepted": 5, "duplicates": 0}
    assert t.post([beat(4, run="paged"), beat(5, run="paged")]).json() == {"accepted": 1, "duplicates": 1}
    r = requests.get(t.url + "/api/v1/runs/paged/heartbeats", params={"after": 2, "limit": 2}, headers=t.headers(),
                     timeout=10)
    assert [b["seq"] for b in r.json()["heartbeats"]] == [3, 4] and r.json()["next_after"] == 4
    run = {r["run"]: r for r in t.runs()}["paged"]
    assert run["seq"] == 5 and run["liveness"] == "ok"


@pytest.mark.integration
def test_limits_and_validation(shared_tracker):
    t = shared_tracker
    r = requests.post(t.url + "/api/v1/heartbeats", data=b"x" * 70000, headers=t.headers(), timeout=10)
    assert r.status_code == 413
    r = requests.post(t.url + "/api/v1/heartbeats", data=b"{not json", headers=t.headers(), timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    r = requests.post(t.url + "/api/v1/heartbeats", data=b'{"heartbeats": [{"seq": NaN}]}', headers=t.headers(),
                      timeout=10)
    assert r.status_code == 400
    r = t.post([beat(0), dict(beat(1), seq=-1)])
    assert r.status_code == 400 and r.json()["index"] == 1 and "seq" in r.json()["error"]
    r = requests.get(t.url + "/api/v1/runs/r1/heartbeats", params={"limit": "0"}, headers=t.headers(), timeout=10)
    assert r.status_code == 400
    r = requests.get(t.url + "/api/v1/runs/..%2Fetc/heartbeats", headers=t.headers(), timeout=10)
    assert 400 <= r.status_code < 500


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20)

beat_like = st.fixed_dictionaries(
    {"schema": st.sampled_from(["onbox.heartbeat/1", "onbox.heartbeat/2", 1]),
     "run": st.one_of(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,10}", fullmatch=True), st.text(max_size=5)),
     "box": st.text(max_size=5), "attempt": json_values, "seq": json_values, "time": json_values,
     "state": st.text(max_size=5)},
    optional={"progress": json_values, "alerts": json_values, "disks": json_values, "gpus": json_values,
              "interval_s": json_values})


@pytest.mark.integration
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.lists(beat_like, max_size=3).map(lambda bs: json.dumps({"heartbeats": bs}).encode()),
))
def test_fuzz_post_never_500(shared_tracker, body):
    t = shared_tracker
    r = requests.post(t.url + "/api/v1/heartbeats", data=body, headers=t.headers(), timeout=10)
    assert r.status_code in (200, 400, 413), (r.status_code, r.text)
    assert isinstance(r.json(), dict)


@pytest.mark.integration
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run=st.text(max_size=20), after=st.text(max_size=8), limit=st.text(max_size=8))
def test_fuzz_get_never_500(shared_tracker, run, after, limit):
    t = shared_tracker
    path = "/api/v1/runs/%s/heartbeats" % requests.utils.quote(run, safe="")
    r = requests.get(t.url + path, params={"after": after, "limit": limit}, headers=t.headers(), timeout=10)
    assert r.status_code < 500, (r.status_code, r.text)


@pytest.mark.integration
def test_chunked_body_over_the_limit_is_413(shared_tracker):
    t = shared_tracker

    def chunks():  # no Content-Length: the limit must hold while streaming
        for _ in range(40):
            yield b" " * 4096

    r = requests.post(t.url + "/api/v1/heartbeats", data=chunks(), headers=t.headers(), timeout=10)
    assert r.status_code == 413


@pytest.mark.integration
def test_public_read_opens_reads_only(tmp_path):
    t = TrackerProcess(str(tmp_path / "pub"), public_read=True)
    t.start()
    try:
        assert t.post([beat(0, run="pub")]).status_code == 200
        assert requests.get(t.url + "/api/v1/runs", timeout=10).status_code == 200
        r = requests.get(t.url + "/api/v1/runs/pub/heartbeats", timeout=10)
        assert r.status_code == 200 and r.json()["heartbeats"][0]["seq"] == 0
        r = requests.post(t.url + "/api/v1/heartbeats", json={"heartbeats": [beat(1, run="pub")]}, timeout=10)
        assert r.status_code == 401
    finally:
        t.stop()


numbers = st.one_of(st.integers(-2**80, 2**80), st.floats(allow_nan=False, allow_infinity=False), st.none(),
                    st.sampled_from(["NaN", "Infinity", "-Infinity", "x"]))


@pytest.mark.integration
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(time_=numbers, seq=st.integers(-2, 2**60), attempt=st.integers(-2, 2**60), step=numbers, loss=numbers,
       interval=numbers)
def test_fuzz_numeric_extremes_in_well_formed_beats(shared_tracker, time_, seq, attempt, step, loss, interval):
    """Well-formed beats with extreme numbers: stored (200) when valid, 400 otherwise, never a 5xx."""
    b = beat(0, run="nums")
    b.update(time=time_, seq=seq, attempt=attempt, interval_s=interval, progress={"step": step, "loss": loss})
    r = shared_tracker.post([b])
    assert r.status_code in (200, 400), (r.status_code, r.text)
