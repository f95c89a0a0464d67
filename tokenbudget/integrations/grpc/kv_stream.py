"""The pool's KV events (``kv_cache.events``) as the proto's ``KvEventBatch`` stream.

A subscriber first gets the live blocks as one snapshot batch (``KvSnapshotChunk`` 0 of 1:
an ``AllBlocksCleared`` then every live block, parents before children, numbered with the
sequence the snapshot was taken at), then every batch the engine publishes after it, numbered
one more each time, with no gap and no duplicate: ``KVEventLog.subscribe`` takes the snapshot
and registers the listener under one lock. The listener runs in the engine's step thread and
only hands the batch to the subscriber's event loop.
"""

from __future__ import annotations

import asyncio
import time

from smg_grpc_proto.generated import common_pb2

from tokenbudget.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog

_LOCAL = common_pb2.KV_CACHE_LOCALITY_LOCAL
_DEVICE = common_pb2.KV_CACHE_TIER_DEVICE


def event_proto(event, event_id: int) -> common_pb2.KvCacheEvent:
    if isinstance(event, BlockStored):
        stored = common_pb2.KvBlocksStored(
            blocks=[common_pb2.KvBlock(block_hash=event.block_hash, token_ids=event.token_ids,
                                       block_size=event.block_size)],
            tier=_DEVICE, locality=_LOCAL)
        if event.parent_hash is not None:
            stored.parent_block_hash = event.parent_hash
        return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(event, BlockRemoved):
        return common_pb2.KvCacheEvent(event_id=event_id, removed=common_pb2.KvBlocksRemoved(
            block_hashes=[event.block_hash], tier=_DEVICE, locality=_LOCAL))
    assert isinstance(event, AllBlocksCleared)
    return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())


def batch_proto(sequence: int, events, snapshot: bool = False) -> common_pb2.KvEventBatch:
    batch = common_pb2.KvEventBatch(sequence_number=sequence, timestamp=time.time(), dp_rank=0,
                                    events=[event_proto(e, 0 if snapshot else i + 1) for i, e in enumerate(events)])
    if snapshot:
        batch.snapshot.CopyFrom(common_pb2.KvSnapshotChunk(index=0, count=1, blocks=len(events) - 1,
                                                           unknown_before=0))
    return batch


async def kv_event_batches(log: KVEventLog):
    """Yield the snapshot batch, then every published batch, until the caller stops iterating."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def listener(sequence: int, events) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (sequence, events))
        except RuntimeError:  # the subscriber's loop has closed
            pass

    sequence, live = log.subscribe(listener)
    try:
        yield batch_proto(sequence, [AllBlocksCleared(), *live], snapshot=True)
        while True:
            sequence, events = await queue.get()
            yield batch_proto(sequence, events)
    finally:
        log.unsubscribe(listener)
