"""Waiting queues for the two policies.

FCFS: arrival order, except that a preempted request goes back to the head.
Priority: smallest ``(priority, arrival_index)`` first; a preempted request keeps its key, so it
comes back in its rightful place.

``remove`` and ``pop_head`` return where the request was and ``prepend(request, index)`` puts it
back there (the undo of a step that admitted it: ``Scheduler._undo_admit``); a preempted request
is prepended at the head, index 0. One insertion, so the queues have no undo method of their own.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from tokenbudget.scheduler.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request, index: int = 0) -> None:
        """Put ``request`` at ``index`` (the head by default)."""
        self._q.insert(index, request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> int:
        index = self._q.index(request)
        del self._q[index]
        return index

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_index, request))

    def prepend(self, request: Request, index: int | None = None) -> None:
        """Back in the queue: the key alone fixes the place (``index`` is ignored)."""
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[2] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[2] for e in sorted(self._heap, key=lambda e: (e[0], e[1])))


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()


def heads(waiting):
    """The waiting queue's head, again and again, while the caller keeps admitting."""
    while len(waiting):
        yield waiting.peek()


def pop_head(waiting) -> int:
    """Take the head; its position (for ``prepend``)."""
    waiting.pop()
    return 0
