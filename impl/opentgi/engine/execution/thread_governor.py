"""How many torch threads each engine step gets on CPU: as many as there are cores free of other work.

torch's CPU wheels run a parallel op as a GNU OpenMP team whose threads meet at a barrier after
every region and spin while they wait there. When other work holds a core (the HTTP thread parsing
a burst of requests, tokenizer threads, a load generator or another service on the machine), a team
thread is preempted and its partner spins through its time slices waiting for it: a team wider
than the free cores is slower, by far, than one that fits them (figures: docs/cpu.md).

So the engine loop measures, over windows of at least `WINDOW_S`, how many cores the machine spent
on anything but the engine's own team: the busy time of the cores this process may run on
(/proc/stat) less the engine thread's CPU time times the team size. The next steps get the cores
left, rounded, between 1 and the configured count. Linux only; elsewhere, or with `--fixed-threads`,
the count stays as configured.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

WINDOW_S = 0.1  # /proc/stat counts in clock ticks (USER_HZ): a shorter window would be mostly rounding
STAT_PATH = "/proc/stat"


def busy_core_seconds(cpus: set[int], path: str = STAT_PATH) -> float | None:
    """Seconds the given cores spent busy since boot (user, nice, system, irq, softirq and time
    stolen by a hypervisor), from /proc/stat; None where there is no such file."""
    try:
        with open(path) as fh:
            lines = fh.readlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
        ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """Called by the engine loop's thread after every step (`after_step`) and when the loop goes
    idle (`reset`); sets that thread's torch thread count when the cores free of other work
    change."""

    def __init__(self, max_threads: int, cpus: set[int] | None = None,
                 busy: Callable[[], float | None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 thread_clock: Callable[[], float] = time.thread_time,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        self.max_threads = max_threads
        self.threads = max_threads
        self.cpus = cpus if cpus is not None else set(os.sched_getaffinity(0))
        self._busy = busy or (lambda: busy_core_seconds(self.cpus))
        self._clock, self._thread_clock, self._set_threads = clock, thread_clock, set_threads
        self._mark: tuple[float, float, float] | None = None  # wall, machine busy, engine thread CPU
        self.others = 0.0  # cores other work held in the last window

    @classmethod
    def for_settings(cls, num_threads: int | None, fixed: bool, device: torch.device) -> ThreadGovernor | None:
        """A governor for the engine loop on `device`, or None where the count stays as configured."""
        if fixed or device.type != "cpu" or not num_threads or num_threads < 2 or busy_core_seconds({0}) is None:
            return None
        return cls(num_threads)

    def reset(self) -> None:
        """Start a new window at the next step (what happened while the loop was idle is not
        what the next steps will meet)."""
        self._mark = None

    def after_step(self) -> None:
        now = self._clock()
        if self._mark is not None and now - self._mark[0] < WINDOW_S:
            return  # /proc/stat is read once a window, not at every step
        busy = self._busy()
        if busy is None:
            return
        engine = self._thread_clock()
        if self._mark is None:
            self._mark = (now, busy, engine)
            return
        wall = now - self._mark[0]
        ours = (engine - self._mark[2]) * self.threads  # the team's other threads run as long as this one
        self.others = max(0.0, busy - self._mark[1] - ours) / wall
        self._mark = (now, busy, engine)
        threads = max(1, min(self.max_threads, int(len(self.cpus) - self.others + 0.5)))
        if threads != self.threads:
            self.threads = threads
            self._set_threads(threads)
