"""The batcher: items queued during a batch join the next; Again carries an item on."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from specserve.serving.batching import Again, Batcher


def test_an_item_carried_on_keeps_its_future_and_queued_items_join_it():
    batches: list[list] = []

    def process(items):
        batches.append(list(items))
        # ("decode", n): n more passes; anything else is done at once.
        return [Again(("decode", item[1] - 1)) if item[1] > 1 else item for item in items]

    batcher = Batcher(process, max_batch=8, max_wait_s=0, name="test", own_thread=False)
    worker = threading.Thread(target=batcher.run)
    decode = batcher.submit_async(("decode", 3))
    worker.start()
    assert decode.result(timeout=5) == ("decode", 1)
    other = batcher.submit_async(("call", 1))
    assert other.result(timeout=5) == ("call", 1)
    batcher.close()
    worker.join(timeout=5)
    assert [item for batch in batches for item in batch if item[0] == "decode"] == [
        ("decode", 3), ("decode", 2), ("decode", 1)]  # fmt: skip


def test_queued_calls_share_batches_with_carried_items_and_get_up_to_half_of_them():
    hold = threading.Event()
    batches: list[list] = []

    def process(items):
        batches.append(list(items))
        if len(batches) == 1:
            hold.wait(5)  # while the first batch runs, calls queue behind it
        return [Again(item) if item.startswith("decode") and len(batches) < 8 else item for item in items]

    batcher = Batcher(process, max_batch=8, max_wait_s=0.05, name="test", own_thread=False)
    decodes = [batcher.submit_async(f"decode-{i}") for i in range(8)]
    worker = threading.Thread(target=batcher.run)
    worker.start()
    while not batches:
        pass
    calls = [batcher.submit_async(f"call-{i}") for i in range(6)]
    hold.set()
    assert [c.result(timeout=5) for c in calls] == [f"call-{i}" for i in range(6)]
    assert all(d.result(timeout=5).startswith("decode") for d in decodes)
    batcher.close()
    worker.join(timeout=5)
    assert all(len(batch) <= 8 for batch in batches)
    second, third = batches[1], batches[2]
    assert sum(i.startswith("call") for i in second) == 4  # half the batch, beside 4 carried decodes
    assert sum(i.startswith("decode") for i in second) == 4
    assert sum(i.startswith("call") for i in third) == 2 and sum(i.startswith("decode") for i in third) == 6


def test_carried_items_that_fill_a_batch_leave_a_place_for_a_queued_one():
    release = threading.Event()
    batches: list[list] = []

    def process(items):
        batches.append(list(items))
        if not release.is_set() and len(batches) == 1:
            release.wait(5)  # hold the first batch while a call queues behind it
        return [Again(item) if item.startswith("decode") and len(batches) < 6 else item for item in items]

    batcher = Batcher(process, max_batch=2, max_wait_s=0.05, name="test", own_thread=False)
    worker = threading.Thread(target=batcher.run)
    decodes = [batcher.submit_async(f"decode-{i}") for i in range(2)]
    worker.start()
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(batcher.submit, "call")
        while batcher.pending == 0:
            pass
        release.set()
        assert call.result(timeout=5) == "call"
    assert all(d.result(timeout=5).startswith("decode") for d in decodes)
    batcher.close()
    worker.join(timeout=5)
    assert all(len(batch) <= 2 for batch in batches)
    served_at = next(i for i, batch in enumerate(batches) if "call" in batch)
    assert served_at == 1  # right after the batch it queued behind, not after the decodes end


def test_with_room_for_one_the_batcher_alternates_and_still_stops():
    batches: list[list] = []

    def process(items):
        batches.append(list(items))
        return [Again(item) if item == "decode" and len(batches) < 4 else item for item in items]

    batcher = Batcher(process, max_batch=1, max_wait_s=0, name="test", own_thread=False)
    decode = batcher.submit_async("decode")
    call = batcher.submit_async("call")
    batcher.close()  # queued behind both: the worker ends once the decode is done
    batcher.run()
    assert decode.result(timeout=1) == "decode" and call.result(timeout=1) == "call"
    assert batches[:2] == [["decode"], ["call"]]
