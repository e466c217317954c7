"""Gradio's queue, polled less while nobody uses the page (each wake-up of the event loop takes a
core from the engine's OpenMP threads; see `patient_queue`)."""

import time

QUEUE_POLL_S = 0.01  # how often Gradio's queue looks for new events while the page is in use (its default: 1 ms)
IDLE_QUEUE_POLL_S = 0.1  # and while no visitor has sent anything for PAGE_ACTIVE_S
PAGE_ACTIVE_S = 10.0
PROGRESS_POLL_S = 1.0  # for progress updates, which this page does not send (Gradio's default: 10 ms)


def patient_queue(queue_class):
    """Gradio's queue, polling for new events every IDLE_QUEUE_POLL_S while the page is unused.

    Each wake-up of the event loop takes a core from the engine's OpenMP threads (the cost is in
    docs/benchmarks-history.md), so the queue polls at QUEUE_POLL_S only while the page is used (an
    event queued or running, or one pushed within PAGE_ACTIVE_S): a visitor's first message after a
    quiet spell starts at most IDLE_QUEUE_POLL_S later, the next ones as before."""

    class PatientQueue(queue_class):
        _last_push = float("-inf")

        @property
        def sleep_when_free(self) -> float:
            busy = len(self) > 0 or any(job is not None for job in self.active_jobs)
            recent = time.monotonic() - self._last_push < PAGE_ACTIVE_S
            return QUEUE_POLL_S if busy or recent else IDLE_QUEUE_POLL_S

        @sleep_when_free.setter
        def sleep_when_free(self, value) -> None:  # Gradio's __init__ sets its default
            pass

        async def push(self, *args, **kwargs):
            self._last_push = time.monotonic()
            return await super().push(*args, **kwargs)

    return PatientQueue


def slow_queue_polling(demo) -> None:
    """Gradio's queue checks for new events every 1 ms while it is free (on Linux); see
    `patient_queue`. Its progress loop wakes every 10 ms for updates this page never sends."""
    queue = getattr(demo, "_queue", None)
    if queue is None:
        return
    queue.__class__ = patient_queue(type(queue))
    queue.progress_update_sleep_when_free = max(getattr(queue, "progress_update_sleep_when_free", 0),
                                                PROGRESS_POLL_S)
