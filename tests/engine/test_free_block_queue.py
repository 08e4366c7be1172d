"""FreeBlockQueue takes blocks in the order an explicit list of every free id would (hypothesis),
and a BlockManager makes a block's record only when the block is first taken."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, strategies as st

from tengyun.engine.block_manager import BlockManager
from tengyun.engine.free_block_queue import FreeBlockQueue
from tengyun.engine.sequence import Sequence
from tengyun.sampling_params import SamplingParams

NUM_BLOCKS = 8


class ListedQueue:
    """The reference: every free id listed, never-used ones included, in taking order."""

    def __init__(self, num_blocks: int):
        self.ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    def pop_front(self) -> int:
        return self.ids.popitem(last=False)[0]

    def push_front(self, block_id: int) -> None:
        self.ids[block_id] = None
        self.ids.move_to_end(block_id, last=False)

    def push_back(self, block_id: int) -> None:
        self.ids[block_id] = None

    def remove(self, block_id: int) -> None:
        del self.ids[block_id]


# Each step: take a block, or give back the i-th taken one to the front or the back, or take
# the i-th given-back-to-the-back one out again (a prefix-cache hit).
STEPS = st.lists(st.tuples(st.sampled_from(["pop", "front", "back", "remove"]), st.integers(0, NUM_BLOCKS)),
                 max_size=60)


@given(STEPS)
def test_the_queue_takes_blocks_in_the_order_of_a_listed_queue(steps):
    queue, listed = FreeBlockQueue(NUM_BLOCKS), ListedQueue(NUM_BLOCKS)
    taken: list[int] = []
    hashed_free: list[int] = []
    for op, i in steps:
        if op == "pop" and len(listed.ids):
            block_id = queue.pop_front()
            assert block_id == listed.pop_front()
            taken.append(block_id)
            if block_id in hashed_free:
                hashed_free.remove(block_id)
        elif op in ("front", "back") and taken:
            block_id = taken.pop(i % len(taken))
            (queue.push_front if op == "front" else queue.push_back)(block_id)
            (listed.push_front if op == "front" else listed.push_back)(block_id)
            if op == "back":
                hashed_free.append(block_id)
        elif op == "remove" and hashed_free:
            block_id = hashed_free.pop(i % len(hashed_free))
            queue.remove(block_id)
            listed.remove(block_id)
            taken.append(block_id)
        assert list(queue) == list(listed.ids)
        assert len(queue) == len(listed.ids)
        assert all(b in queue for b in listed.ids) and not any(b in queue for b in taken)


def test_an_empty_queue_says_so():
    queue = FreeBlockQueue(1)
    assert queue.pop_front() == 0
    try:
        queue.pop_front()
    except IndexError as error:
        assert "no free KV block" in str(error)
    else:
        raise AssertionError("popped a block from an empty queue")


def test_a_block_manager_records_only_the_blocks_taken():
    """A 4 GiB cache of a tiny model has ~1M blocks; a record for each cost ~2 s at every start."""
    bm = BlockManager(num_blocks=10_000_000, block_size=4, enable_prefix_caching=True)
    assert bm.blocks == [] and bm.num_free_blocks == 10_000_000
    seq = Sequence(0, "0", 0, list(range(10)), SamplingParams(), arrival_order=0)
    bm.allocate(seq, 10)
    assert seq.block_table == [0, 1, 2] and len(bm.blocks) == 3
    bm.free(seq)
    assert bm.num_free_blocks == 10_000_000
    assert next(iter(bm.free_queue)) == 2  # the unhashed tail block is taken first
