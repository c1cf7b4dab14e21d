"""Spool and sender through fake sinks: order, ack-only removal, batching, bound + dropped count, rejection."""
from __future__ import annotations

import random
import threading
import time

from onbox.heartbeat.sinks import Backoff, Rejected, Sender, SinkError
from onbox.heartbeat.spool import SeqCounter, Spool


class FakeSink:
    name = "fake"

    def __init__(self):
        self.batches = []
        self.fail = 0  # fail this many sends
        self.reject_seqs = set()
        self.lock = threading.Lock()

    def send(self, beats):
        with self.lock:
            if self.fail > 0:
                self.fail -= 1
                raise SinkError("down")
            if any(b["seq"] in self.reject_seqs for b in beats):
                raise Rejected("bad", 400)
            self.batches.append([b["seq"] for b in beats])

    def close(self):
        pass

    def seqs(self):
        return [s for b in self.batches for s in b]


def fill(spool, n, start=0):
    for seq in range(start, start + n):
        spool.put(seq, {"seq": seq})


def test_spool_survives_reopen_and_acks_remove(tmp_path):
    sp = Spool(str(tmp_path / "s"))
    fill(sp, 5)
    sp.ack([0, 1])
    sp2 = Spool(str(tmp_path / "s"))
    assert [s for s, _ in sp2.pending(10)] == [2, 3, 4]


def test_bound_drops_oldest_and_counts(tmp_path):
    sp = Spool(str(tmp_path / "s"), max_entries=3)
    fill(sp, 5)
    assert [s for s, _ in sp.pending(10)] == [2, 3, 4]
    assert sp.dropped == 2
    assert Spool(str(tmp_path / "s")).dropped == 2  # persisted


def test_seq_counter_persists(tmp_path):
    c = SeqCounter(str(tmp_path / "seq.json"), first=1000)
    assert [c.next(), c.next()] == [1000, 1001]
    again = SeqCounter(str(tmp_path / "seq.json"), first=5)  # an existing counter ignores `first`
    assert again.next() == 1002 and again.first == 1000


def test_sender_in_order_batches_backlog_and_retries(tmp_path):
    sp = Spool(str(tmp_path / "s"))
    sink = FakeSink()
    sink.fail = 3
    fill(sp, 25)
    sender = Sender(sink, sp, batch_size=10, backoff=Backoff(base=0.001, cap=0.01))
    for _ in range(10):
        sender.push_once()
    assert sink.seqs() == list(range(25))
    assert sink.batches[0] == list(range(10))  # a backlog goes in batches
    assert sp.backlog() == 0


def test_rejected_beat_is_isolated_and_dropped(tmp_path):
    sp = Spool(str(tmp_path / "s"))
    sink = FakeSink()
    sink.reject_seqs = {3}
    fill(sp, 6)
    sender = Sender(sink, sp, batch_size=10)
    sender.push_once()
    assert sink.seqs() == [0, 1, 2, 4, 5] and sender.rejected == 1 and sp.backlog() == 0


def test_thread_delivers_and_flushes(tmp_path):
    sp = Spool(str(tmp_path / "s"))
    sink = FakeSink()
    sink.fail = 2
    sender = Sender(sink, sp, backoff=Backoff(base=0.01, cap=0.05))
    sender.start()
    try:
        for seq in range(20):
            sp.put(seq, {"seq": seq})
            sender.notify()
        assert sender.flush(10.0)
    finally:
        sender.stop()
    assert sink.seqs() == list(range(20))


def test_backoff_grows_with_full_jitter_and_caps():
    b = Backoff(base=1.0, cap=8.0, floor=0.0, rng=random.Random(3))
    delays = [b.next_delay() for _ in range(12)]
    assert all(0 <= d <= 8.0 for d in delays)
    assert max(delays[:2]) <= 2.0
    b.reset()
    assert b.next_delay() <= 1.0


def test_flush_is_bounded_when_sink_is_down(tmp_path):
    sp = Spool(str(tmp_path / "s"))
    sink = FakeSink()
    sink.fail = 10**9
    fill(sp, 3)
    sender = Sender(sink, sp, backoff=Backoff(base=0.01, cap=0.02))
    sender.start()
    t0 = time.monotonic()
    assert sender.flush(0.3) is False
    sender.stop()
    assert time.monotonic() - t0 < 5
    assert sp.backlog() == 3  # nothing removed without an ack


def test_sink_configuration_errors_are_usage_errors(tmp_path):
    import pytest

    from onbox.errors import UsageError
    from onbox.heartbeat.sinks import PingSink, TrackerSink

    with pytest.raises(UsageError, match="token file"):
        TrackerSink("http://127.0.0.1:1", token_file=str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="not an http"):
        TrackerSink("127.0.0.1:8787")
    with pytest.raises(UsageError, match="not an http"):
        PingSink("hc-ping.com/abc")
    assert TrackerSink("http://x:1", environ={"ONBOX_TRACKER_TOKEN": "t"}).token == "t"
