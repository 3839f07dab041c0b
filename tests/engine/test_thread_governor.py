"""The engine loop's torch thread count follows the cores other work leaves free."""

from __future__ import annotations

import torch

from opentgi.engine.execution.thread_governor import ThreadGovernor, busy_core_seconds


class Machine:
    """A fake clock, engine-thread CPU clock and machine busy counter, advanced by `run`."""

    def __init__(self):
        self.now = self.engine_cpu = self.busy = 0.0
        self.counts: list[int] = []

    def governor(self, max_threads=2, cpus=(0, 1)):
        return ThreadGovernor(max_threads, set(cpus), busy=lambda: self.busy, clock=lambda: self.now,
                              thread_clock=lambda: self.engine_cpu, set_threads=self.counts.append)

    def run(self, gov: ThreadGovernor, seconds: float, others: float, steps: int = 4) -> None:
        """`steps` engine steps over `seconds`: the team busy throughout, other work on `others`
        cores."""
        for _ in range(steps):
            dt = seconds / steps
            self.now += dt
            self.engine_cpu += dt
            self.busy += dt * (gov.threads + others)
            gov.after_step()


def test_gives_up_a_thread_while_other_work_holds_a_core_and_takes_it_back():
    m = Machine()
    gov = m.governor()
    m.run(gov, 0.5, others=0.1)
    assert gov.threads == 2 and m.counts == []
    m.run(gov, 0.5, others=0.9)
    assert gov.threads == 1 and m.counts == [1]
    assert abs(gov.others - 0.9) < 1e-6
    m.run(gov, 0.5, others=0.8)  # still held: stays at one
    assert m.counts == [1]
    m.run(gov, 0.5, others=0.05)
    assert gov.threads == 2 and m.counts == [1, 2]


def test_never_below_one_nor_above_the_configured_count():
    m = Machine()
    gov = m.governor(max_threads=3, cpus=(0, 1, 2, 3))
    m.run(gov, 0.5, others=0.0)
    assert gov.threads == 3 and m.counts == []  # 4 cores free, 3 configured
    m.run(gov, 0.5, others=5.0)
    assert gov.threads == 1
    m.run(gov, 0.5, others=1.6)  # 2.4 cores left
    assert gov.threads == 2


def test_windows_shorter_than_a_tenth_of_a_second_and_idle_time_are_not_judged():
    m = Machine()
    gov = m.governor()
    m.run(gov, 0.08, others=2.0, steps=2)  # one 0.04 s window after the first mark: too short
    assert gov.threads == 2
    gov.reset()  # the loop went idle: others worked meanwhile, the next window starts afresh
    m.now += 5.0
    m.busy += 5.0 * 2
    m.run(gov, 0.5, others=0.0)
    assert gov.threads == 2 and m.counts == []


def test_reads_proc_stat_once_a_window_not_every_step():
    m = Machine()
    reads = []
    gov = ThreadGovernor(2, {0, 1}, busy=lambda: reads.append(1) or m.busy, clock=lambda: m.now,
                         thread_clock=lambda: m.engine_cpu, set_threads=m.counts.append)
    m.run(gov, 1.0, others=0.0, steps=40)  # 25 ms steps: ten windows of 0.1 s
    assert 10 <= len(reads) <= 12


def test_off_when_fixed_on_other_devices_or_with_one_thread():
    cpu = torch.device("cpu")
    assert ThreadGovernor.for_settings(2, True, cpu) is None
    assert ThreadGovernor.for_settings(2, False, torch.device("meta")) is None
    assert ThreadGovernor.for_settings(1, False, cpu) is None
    assert ThreadGovernor.for_settings(None, False, cpu) is None
    assert isinstance(ThreadGovernor.for_settings(2, False, cpu), ThreadGovernor)


def test_reads_busy_time_of_the_given_cores_from_proc_stat(tmp_path):
    import os

    stat = tmp_path / "stat"
    stat.write_text("cpu  900 0 900 900 0 0 0 0 0 0\n"
                    "cpu0 100 10 20 500 7 1 2 3 0 0\n"
                    "cpu1 400 0 0 400 0 0 0 0 0 0\n"
                    "intr 12345\n")
    hz = os.sysconf("SC_CLK_TCK")
    assert busy_core_seconds({0}, str(stat)) == (100 + 10 + 20 + 1 + 2 + 3) / hz
    assert busy_core_seconds({0, 1}, str(stat)) == (136 + 400) / hz
    assert busy_core_seconds({0}, str(tmp_path / "missing")) is None


async def test_the_engine_loop_consults_its_governor_after_steps_and_resets_it_when_idle(llama, monkeypatch):
    import asyncio

    from opentgi.config import Settings
    from opentgi.engine import engine as engine_module
    from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams

    calls: list[str] = []

    class Recording:
        def after_step(self):
            calls.append("step")

        def reset(self):
            calls.append("reset")

    asked = []
    monkeypatch.setattr(engine_module.ThreadGovernor, "for_settings",
                        classmethod(lambda cls, n, fixed, device: asked.append((n, fixed, device.type)) or Recording()))
    engine = engine_module.Engine(llama, Settings(max_batch_total_tokens=1024, num_threads=2))
    await engine.start()
    try:
        handle = await engine.submit(GenerationRequest([1, 15, 27], SamplingParams(),
                                                       StoppingParams(max_new_tokens=4, ignore_eos=True)))
        await handle.result()
        for _ in range(100):  # the loop goes idle after the last step
            if calls and calls[-1] == "reset":
                break
            await asyncio.sleep(0.01)
    finally:
        await engine.stop()
    assert asked == [(2, False, "cpu")]
    assert calls.count("step") >= 4 and calls[-1] == "reset"
