"""SuperOffload's deferred-step pieces on their own: the worker's queue takes the job earliest in forward order
among those whose gradient has arrived (the oldest when none has), and the bucket tracker says a bucket is
ready only once every one of its elements was stepped, whatever the jobs' cuts, and passes a failure on."""
from __future__ import annotations

import threading

import pytest

from deepspeed_c.runtime.superoffload.deferred import BucketTracker
from deepspeed_c.runtime.superoffload.job_queue import ForwardOrderQueue


def test_queue_takes_forward_order_among_arrived_jobs():
    q = ForwardOrderQueue()
    there = {"a": True, "b": False, "c": True}
    for name, key in (("a", (0, 300)), ("b", (0, 100)), ("c", (0, 200))):  # backward: last layers first
        q.put(key, name, lambda n=name: there[n])
    assert q.get() == "c"  # b (earlier in forward order) is still being copied down
    there["b"] = True
    assert q.get() == "b"
    assert q.get() == "a"
    q.task_done(), q.task_done(), q.task_done()
    assert q.idle()


def test_queue_takes_the_oldest_when_none_has_arrived_and_join_waits():
    q = ForwardOrderQueue()
    q.put((0, 50), "late", lambda: False)
    q.put((0, 10), "later", lambda: False)
    assert q.get() == "late"
    done = []
    t = threading.Thread(target=lambda: (q.join(), done.append(1)))
    t.start()
    t.join(0.05)
    assert not done  # one job running, one queued
    q.task_done()
    assert q.get() == "later"
    q.task_done()
    t.join(5)
    assert done


def test_tracker_marks_buckets_ready_across_job_cuts():
    tr = BucketTracker([[(0, 10), (10, 30)], [(0, 5)]])
    tr.stepped(0, 0, 6, "e1", "src")
    assert (0, 0) not in tr.ready
    tr.stepped(0, 6, 20, "e2", "src")  # ends bucket 0, half of bucket 1
    assert tr.wait((0, 0)) == ("e2", "src") and (0, 1) not in tr.ready
    tr.stepped(0, 20, 30, "e3", "src")
    tr.stepped(1, 0, 5, "e4", "src1")
    assert tr.wait((0, 1)) == ("e3", "src") and tr.wait((1, 0)) == ("e4", "src1")
    tr.clear()
    assert not tr.ready and not tr.left


def test_tracker_wait_raises_when_the_worker_failed():
    tr = BucketTracker([[(0, 4)]])
    threading.Timer(0.02, tr.fail, args=(ValueError("kernel"),)).start()
    with pytest.raises(RuntimeError, match="host step failed"):
        tr.wait((0, 0))
