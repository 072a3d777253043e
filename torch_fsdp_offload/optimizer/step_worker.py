"""The thread that runs optimizer steps off the caller's thread, in the order gradients land."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import Any, Callable

__all__ = ["IDLE_SECONDS", "StepWorker"]

# How long an idle thread waits for the next step before it ends. A backward's landings come closer
# together than this; an interpreter exiting with an idle worker waits at most this long.
IDLE_SECONDS = 0.2


class StepWorker:
    """One thread running submitted steps: of those whose gradients have landed, the most
    recently submitted first; when none has, the oldest, whose gradients land first. One worker
    runs the host steps; another the streamed groups' pipeline, one task per ``step()``.

    In backward, the host submits a group's step when it issues the group's gradient copy, and the
    CPU runs ahead of the GPU: the newest submission is then the group whose gradients land last,
    so the worker takes the oldest and steps groups as they land. After backward every gradient
    has landed and the newest group is the first the next forward needs: newest-first steps the
    backlog in forward order (see docs/design.md, "Host step order").

    The thread runs while steps are queued, ending :data:`IDLE_SECONDS` after the last (a dropped
    optimizer leaves no thread behind), and is not a daemon: the interpreter waits for every
    submitted step before it exits, as a step killed half-way inside a kernel or a copy aborts the
    process.

    Args:
        name (str): the thread's name.

    Example::

        >>> worker = StepWorker("host_steps")
        >>> worker.submit(inner.step, landed=group.grads_landed).result()
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self._running = False  # a thread serves the queue (under _ready)

    def submit(self, fn: Callable[..., Any], *args: Any, landed: Callable[[], bool] | None = None) -> concurrent.futures.Future:
        """Queue ``fn(*args)``; ``landed`` says whether its gradients have landed (default: yes)."""
        return self.submit_all([(fn, args, landed)])[0]

    def submit_all(self, tasks: list[tuple[Callable[..., Any], tuple, Callable[[], bool] | None]]) -> list[concurrent.futures.Future]:
        """Queue each ``(fn, args, landed)`` of ``tasks`` at once, in order: an idle thread chooses
        among all of them, not the first alone (see :meth:`submit`)."""
        futures: list[concurrent.futures.Future] = []
        with self._ready:
            for fn, args, landed in tasks:
                futures.append(concurrent.futures.Future())
                self._queue.append((futures[-1], fn, args, landed))
            if self._running:
                self._ready.notify()
            else:
                self._running = True
                threading.Thread(target=self._run, name=self.name).start()
        return futures

    def _take(self) -> Any:
        landed = [index for index, task in enumerate(self._queue) if task[3] is None or task[3]()]
        index = landed[-1] if landed else 0
        task = self._queue[index]
        del self._queue[index]
        return task

    def _run(self) -> None:
        while True:
            with self._ready:
                if not self._queue:
                    self._ready.wait(IDLE_SECONDS)
                if not self._queue:
                    self._running = False
                    return
                task = self._take()
            future, fn, args, landed = task
            # Nothing of a finished step stays referenced while the thread waits for the next:
            # the step's bound method would keep its optimizer (and pinned buffers) alive, the
            # landed check its group.
            del task, landed
            if future.set_running_or_notify_cancel():
                # The step's references go before its future is set: whoever waits on it may drop
                # the optimizer right away.
                try:
                    result = fn(*args)
                except BaseException as error:  # handed to whoever waits on the future
                    del fn, args
                    future.set_exception(error)
                else:
                    del fn, args
                    future.set_result(result)
                    del result
            else:
                del fn, args
            del future
