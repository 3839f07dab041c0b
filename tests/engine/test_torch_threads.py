"""One OpenMP team per server process (engine/execution/torch_threads.py): the event-loop thread runs torch on
one thread, the model loads in a thread of its own, the engine's loop thread gets the torch threads."""

from __future__ import annotations

import threading

import pytest
import torch

from opentgi import cli
from opentgi.config import Settings
from opentgi.engine.engine import Engine
from opentgi.engine.execution import torch_threads
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.models import loader
from opentgi.models.loader import ModelLoadError, load_model


@pytest.fixture(autouse=True)
def _one_thread_after():
    yield
    torch.set_num_threads(1)  # the suite's count, for the threads started after this test


def test_call_in_own_thread_runs_in_a_new_thread_with_its_count():
    torch_threads.keep_calling_thread_serial()
    caller = threading.current_thread()
    thread, count = torch_threads.call_in_own_thread(lambda: (threading.current_thread(), torch.get_num_threads()), 2)
    assert thread is not caller and count == 2
    assert torch.get_num_threads() == 1  # the caller's own count is left alone


def test_call_in_own_thread_raises_what_the_function_raised():
    def fail():
        raise ModelLoadError("no such model")

    with pytest.raises(ModelLoadError, match="no such model"):
        torch_threads.call_in_own_thread(fail, None)


def test_engine_loads_the_model_off_the_calling_thread(monkeypatch, tiny_llama):
    seen = []

    def spy(settings, tp=None):
        seen.append(threading.current_thread())
        return load_model(settings)

    monkeypatch.setattr(loader, "load_model", spy)
    Engine.from_settings(Settings(model_id=str(tiny_llama), max_batch_total_tokens=1024, num_threads=1))
    assert len(seen) == 1 and seen[0] is not threading.current_thread()


async def test_the_loop_thread_runs_the_model_with_the_configured_threads(llama):
    engine = Engine(llama, Settings(max_batch_total_tokens=1024, num_threads=2,
                                    fixed_threads=True))  # the count as configured, whatever the load
    counts = []
    step = engine.core.step

    def counting_step():
        counts.append(torch.get_num_threads())
        return step()

    engine.core.step = counting_step
    await engine.start()
    try:
        handle = await engine.submit(GenerationRequest([1, 15, 27], SamplingParams(),
                                                       StoppingParams(max_new_tokens=3, ignore_eos=True)))
        await handle.result()
    finally:
        await engine.stop()
    assert counts and set(counts) == {2}
    assert torch.get_num_threads() == 1


def test_serve_keeps_the_event_loop_thread_on_one_torch_thread(monkeypatch):
    seen = {}

    def from_settings(settings, observer=None):
        seen.update(caller=torch.get_num_threads(), engine=settings.num_threads)
        raise ModelLoadError("stop here")

    torch.set_num_threads(2)
    monkeypatch.setattr(Engine, "from_settings", staticmethod(from_settings))
    with pytest.raises(SystemExit, match="stop here"):
        cli.serve(Settings(model_id="unused"))
    assert seen == {"caller": 1, "engine": 2}  # torch's count before, handed to the engine thread
