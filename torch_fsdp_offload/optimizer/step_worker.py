"""The thread that runs optimizer steps off the caller's thread, in the order gradients land."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import weakref
from typing import Any, Callable

__all__ = ["StepWorker", "start_worker"]


class StepWorker:
    """One thread running submitted steps: of those whose gradients have landed, the most
    recently submitted first; when none has, the oldest, whose gradients land first. One worker
    runs the host steps; another the streamed groups' pipeline, one task per ``step()``.

    In backward, the host submits a group's step when it issues the group's gradient copy, and the
    CPU runs ahead of the GPU: the newest submission is then the group whose gradients land last,
    so the worker takes the oldest and steps groups as they land. After backward every gradient
    has landed and the newest group is the first the next forward needs: newest-first steps the
    backlog in forward order (see docs/design.md, "Host step order")."""

    def __init__(self, name: str) -> None:
        self._queue: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

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
            self._ready.notify()
        return futures

    def shutdown(self) -> None:
        """End the thread once the steps already submitted have run."""
        with self._ready:
            self._queue.appendleft(None)  # taken only when no step is left
            self._ready.notify()

    def _take(self) -> Any:
        steps = [index for index, task in enumerate(self._queue) if task is not None]
        if not steps:
            return self._queue.pop()
        landed = [index for index in steps if self._queue[index][3] is None or self._queue[index][3]()]
        index = landed[-1] if landed else steps[0]
        task = self._queue[index]
        del self._queue[index]
        return task

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                task = self._take()
            if task is None:
                return
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


def start_worker(owner: object, name: str) -> StepWorker:
    """A new worker whose thread ends with ``owner`` (a process building several models must get
    their pinned buffers back); the finalizer holds the worker, not ``owner``."""
    worker = StepWorker(name)
    weakref.finalize(owner, worker.shutdown)
    return worker
