"""The tracker's events extension (`POST /api/v1/events`, `GET /api/v1/runs/<run>/events`) on a real store, through
the real app in-process: stored once however often resent, checked at the door (a 4xx naming the event, never a
500), read back in order with a cursor, and the keeper's events reach it."""
from __future__ import annotations

import warnings

import pytest

from controller.tracker.app import create_app
from controller.tracker.store import open_store

with warnings.catch_warnings():  # starlette 1.x would rather have httpx2; httpx is what this venv has
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

TOKEN = "t0ken"
AUTH = {"Authorization": "Bearer " + TOKEN}


@pytest.fixture
def client(tmp_path):
    store = open_store(str(tmp_path / "t.db"))
    with TestClient(create_app(store, TOKEN, thin_every_s=0)) as c:
        yield c
    store.close()


def ev(kind="declared_lost", t=1_800_000_000.5, run="gpt", **kw):
    return dict({"run": run, "time": t, "kind": kind, "text": "declared gpu1 lost", "source": "keeper",
                 "boxes": ["gpu1"], "recovery": 1, "n": 4}, **kw)


def test_events_are_stored_once_and_read_back_in_order(client):
    r = client.post("/api/v1/events", json={"events": [ev("detected", 1.0), ev("declared_lost", 2.0)]}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"accepted": 2, "duplicates": 0}
    r = client.post("/api/v1/events", json={"events": [ev("declared_lost", 2.0), ev("box_chosen", 3.0)]},
                    headers=AUTH)
    assert r.json() == {"accepted": 1, "duplicates": 1}  # a resend after a lost acknowledgement
    doc = client.get("/api/v1/runs/gpt/events", headers=AUTH).json()
    assert [e["kind"] for e in doc["events"]] == ["detected", "declared_lost", "box_chosen"]
    assert doc["events"][1]["boxes"] == ["gpu1"] and doc["events"][1]["recovery"] == 1
    page = client.get("/api/v1/runs/gpt/events?after=%d&limit=1" % doc["events"][0]["id"], headers=AUTH).json()
    assert [e["kind"] for e in page["events"]] == ["declared_lost"] and page["next_after"] == doc["events"][1]["id"]
    assert client.get("/api/v1/runs/other/events", headers=AUTH).json()["events"] == []


@pytest.mark.parametrize("body, says", [
    ({"events": [ev(kind="Declared Lost")]}, "events[0]: kind must be"),
    ({"events": [ev(run="../x")]}, "events[0]: run must be a run name"),
    ({"events": [ev(t=-1)]}, "time must be"),
    ({"events": [ev(t=True)]}, "time must be"),
    ({"events": [ev(text=5)]}, "text must be a string"),
    ({"events": [ev(source="")]}, "source must be"),
    ({"events": [ev(text="x" * 20000)]}, "at most 16384 bytes"),
    ({"events": [ev(), 5]}, "events[1]: an event must be a JSON object"),
    ({"events": [ev()] * 1001}, "at most 1000 events"),
    ({"heartbeats": []}, 'body must be {"events": [...]}'),
])
def test_bad_events_are_a_4xx_naming_the_event(client, body, says):
    r = client.post("/api/v1/events", json=body, headers=AUTH)
    assert r.status_code == 400 and says in r.json()["error"], r.text
    assert client.get("/api/v1/runs/gpt/events", headers=AUTH).json()["events"] == []  # nothing of the batch


def test_events_need_the_token_and_bad_queries_are_400(client):
    assert client.post("/api/v1/events", json={"events": [ev()]}).status_code == 401
    assert client.get("/api/v1/runs/gpt/events").status_code == 401
    assert client.post("/api/v1/events", content=b"{nope", headers=AUTH).status_code == 400
    assert client.post("/api/v1/events", content=b"[" * 100000, headers=AUTH).status_code == 400
    assert client.get("/api/v1/runs/gpt/events?after=-5", headers=AUTH).status_code == 400
    assert client.get("/api/v1/runs/gpt/events?limit=abc", headers=AUTH).status_code == 400
