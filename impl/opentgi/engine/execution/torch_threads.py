"""Which thread runs torch's CPU work, with how many OpenMP threads.

torch's CPU wheels parallelise ops with GNU OpenMP, and an OpenMP team belongs to the thread that
started it. Once two threads of a process each own a team, there are more OpenMP threads than cores;
libgomp then stops spinning between parallel regions and puts its workers to sleep, so every one of
the hundreds of small ops in a decode step pays a wake-up, which makes a step markedly slower than
with one team (figures: docs/cpu.md).

So the server keeps one team alive: the main thread (the event loop) runs torch with one thread, so
it never starts a team; the model loads in a thread of its own, whose team ends with it; the
engine's loop thread sets the count for itself (`apply`).
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def resolve(num_threads: int | None) -> int:
    """The torch thread count to use: the one asked for, else torch's default for this process."""
    return num_threads or torch.get_num_threads()


def keep_calling_thread_serial() -> None:
    """From now on the calling thread runs torch ops on one thread: it starts no OpenMP team of its
    own. Call it in the event-loop thread before it runs any parallel torch op."""
    torch.set_num_threads(1)
    torch.get_num_threads()  # settles this thread's count now (torch sets it up lazily per thread)


def apply(num_threads: int | None) -> None:
    """Give the calling thread `num_threads` torch threads (None: leave it as it is)."""
    if num_threads:
        torch.set_num_threads(num_threads)


def call_in_own_thread(fn: Callable[[], T], num_threads: int | None, name: str = "opentgi-load") -> T:
    """Run `fn` in a new thread with `num_threads` torch threads, wait for it, return its result or
    raise its exception. The thread's OpenMP team ends with the thread."""
    result: list = []
    error: list[BaseException] = []

    def run() -> None:
        apply(num_threads)
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as is
            error.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
