"""KV-cache events (kv_cache/events.py) against the pool they describe.

The state machine of tests/test_scheduler_state_machine.py (requests with shared prefixes,
aborts, steps with drafts, transient and request-tied faults before and after the forward pass,
so clean and dirty rollbacks, preemptions) with an event log on the pool. After every rule:
replaying every published batch into an empty model gives exactly the pool's hashed blocks, and
each stored block's hash is the chained hash of its parent and its token ids (so it names
committed tokens only), and every event is news (no hash stored twice, none removed that is not
held: a rolled-back step's eviction published and then staged again by the rollback would be).
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from tokenbudget.kv_cache.block_pool import BlockPool
from tokenbudget.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog, apply_events
from tokenbudget.kv_cache.hashing import ROOT_HASH
from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.testing.state_machine import SchedulerMachine
from tokenbudget.testing.strategies import scheduler_configs


class EventsMachine(SchedulerMachine):
    @initialize(config=scheduler_configs(), seed=st.integers(0, 2**16), data=st.data(), n=st.integers(2, 6))
    def setup(self, config: SchedulerConfig, seed: int, data, n: int) -> None:
        super().setup(config, seed, data, n)  # admitting requests stores no block: no event is missed
        self.log = KVEventLog()
        self.replayed: dict[int, BlockStored] = {}
        self.h.scheduler.kv.pool.events = self.log
        self.mismatches: list[str] = []
        self.log.subscribe(self._on_batch)

    def _on_batch(self, seq: int, events) -> None:
        """At every publish (a commit, the end of a rollback): the replay equals the pool then,
        not only after the engine retried the step (a retry re-evicts what a rollback restored)."""
        for event in events:  # each event is news: a store of a hash not held, a removal of one held
            if isinstance(event, BlockStored) and event.block_hash in self.replayed:
                self.mismatches.append(f"batch {seq}: {event} stores a hash already stored")
            if isinstance(event, BlockRemoved) and event.block_hash not in self.replayed:
                self.mismatches.append(f"batch {seq}: {event} removes a hash not stored (published twice?)")
            apply_events(self.replayed, [event])
        pool = self.h.scheduler.kv.pool
        if set(self.replayed) != set(pool.cached):
            self.mismatches.append(
                f"batch {seq}: replayed events hold {sorted(set(self.replayed) - set(pool.cached))[:4]} the pool "
                f"lacks, lack {sorted(set(pool.cached) - set(self.replayed))[:4]}; events {events[:4]}")

    @invariant()
    def replay_equals_pool(self) -> None:
        pool = self.h.scheduler.kv.pool
        assert not self.mismatches, self.mismatches[0]
        if self.h.scheduler.in_step:
            return
        assert not self.log.pending, f"events staged but not published between steps: {self.log.pending}"
        assert set(self.replayed) == set(pool.cached)
        size = self.h.scheduler.config.block_size
        for h, event in self.replayed.items():
            parent = ROOT_HASH if event.parent_hash is None else event.parent_hash
            assert len(event.token_ids) == event.block_size == size
            assert hash((parent, event.token_ids)) == h, "a stored event's tokens are not the ones hashed"


TestKVEventsMachine = EventsMachine.TestCase
TestKVEventsMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])


def test_snapshot_and_sequence_for_a_late_subscriber():
    """A subscriber that joins late starts from the live blocks at the sequence it is given and
    then receives exactly the batches after it; a reset publishes a clear at once."""
    pool = BlockPool(4)
    pool.events = log = KVEventLog()
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 11, None, (1, 2))
    pool.cache_block(b, 12, 11, (3, 4))
    log.publish()
    got = []
    seq, snapshot = log.subscribe(lambda s, ev: got.append((s, ev)))
    assert seq == 1 and [e.block_hash for e in snapshot] == [11, 12]
    pool.free_blocks([b, a])
    taken = pool.get_new_blocks(3)  # behind two never-used blocks: b (freed first) is evicted
    log.publish()
    assert got == [(2, [BlockRemoved(12)])] and list(log.live) == [11]
    pool.free_blocks(taken)
    assert pool.reset_prefix_cache()
    assert got[-1] == (3, [AllBlocksCleared()]) and log.live == {}


class SmallPoolEventsMachine(EventsMachine):
    """A pool of 12 blocks of 2 under long shared prefixes: a failed step often evicted cached blocks."""

    fixed_config = SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=6, max_model_len=20, block_size=2,
                                   num_blocks=12, enable_prefix_caching=True, policy="priority")


TestKVEventsSmallPool = SmallPoolEventsMachine.TestCase
TestKVEventsSmallPool.settings = settings(max_examples=150, stateful_step_count=80, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
