"""Shared fixtures: the tiny test models (see tests/helpers/tiny_models.py), one thread for torch.
The hypothesis profiles and the default-model fixtures live in the root conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_models

torch.set_num_threads(1)  # CI has 2 cores and other suites run beside this one


@pytest.fixture(scope="session", autouse=True)
def _float32_by_default():
    """The tests compare against transformers in float32 on whatever CPU runs them: the automatic
    dtype (bfloat16 on CPUs with avx512_bf16/AMX, models/loader.py) is pinned to float32 here,
    for the whole session (module-scoped fixtures load models too).
    tests/models/test_models_dtype.py tests the automatic choice and bfloat16 itself."""
    from opentgi.models import loader

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "cpu_has_bf16", lambda cpuinfo=None: False)
        yield


@pytest.fixture(scope="session", autouse=True)
def _torch_kernels_unless_asked():
    """A GGUF's layers take torch's path in tests (as `--kernels torch`) unless a test asks for
    `kernels="native"`: the tests of the torch path, its formats and its tolerances against
    transformers stay what they test; tests/kernels/ serve GGUFs on the native kernels."""
    from dataclasses import replace

    from opentgi.models import loader

    real = loader._kernel_path

    def pinned(settings, device, quantize):
        return real(replace(settings, kernels="torch") if settings.kernels == "auto" else settings, device, quantize)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "_kernel_path", pinned)
        yield


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir() -> Path:
    return tiny_models.smollm2_tokenizer_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_gguf_tokenizers(tmp_path_factory) -> Path:
    """The tiny GGUF's tokenizer, extracted from the file once per session (the slow part of a first
    start) into an opentgi cache dir's `tokenizers/`."""
    from opentgi.models.checkpoints.gguf_tokenizer import cached_gguf_tokenizer

    root = tmp_path_factory.mktemp("gguf-tokenizers")
    cached_gguf_tokenizer(tiny_models.tiny_gguf_path(), root)
    return root / "tokenizers"


@pytest.fixture
def gguf_cache(tmp_path, tiny_gguf_tokenizers) -> Path:
    """A fresh opentgi cache dir for one test (its packed layers are the test's own), holding the
    tiny GGUF's tokenizer already."""
    import shutil

    shutil.copytree(tiny_gguf_tokenizers, tmp_path / "tokenizers")
    return tmp_path


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return tiny_models.tiny_llama_path()


@pytest.fixture(scope="module")
def llama(tiny_llama):
    """The tiny Llama loaded for the paged engine (one per test module)."""
    from opentgi.config import Settings
    from opentgi.models.loader import load_model

    return load_model(Settings(model_id=str(tiny_llama)))


@pytest.fixture(scope="module")
def engine(tiny_llama):
    """(settings, engine) behind `client`: the tiny Llama, prompts of at most APP_MAX_INPUT tokens
    (tests/helpers/engine.py), APP_MAX_TOTAL in all."""
    from tests.helpers.engine import APP_MAX_INPUT, APP_MAX_TOTAL

    return _engine(tiny_llama, APP_MAX_INPUT, APP_MAX_TOTAL, 1024)


@pytest.fixture(scope="module")
def client(engine):
    """A test client of the whole app (every dialect) over `engine`, started by its lifespan."""
    yield from _test_client(engine)


@pytest.fixture(scope="session")
def tiny_qwen2() -> Path:
    return tiny_models.tiny_qwen2_path()


@pytest.fixture(scope="session")
def tiny_mistral() -> Path:
    return tiny_models.tiny_mistral_path()


@pytest.fixture(scope="session")
def tiny_gpt2() -> Path:
    return tiny_models.tiny_gpt2_path()


@pytest.fixture(scope="session")
def tiny_reward() -> Path:
    return tiny_models.tiny_reward_path()


@pytest.fixture(scope="session")
def tiny_fim_llama() -> Path:
    return tiny_models.tiny_fim_llama_path()


@pytest.fixture(scope="module")
def think_engine():
    """The tiny thinking model (`<think>`, Hermes `<tool_call>`) behind an engine: (settings, engine)."""
    return _engine(tiny_models.tiny_think_llama_path(), 400, 512, 2048)


@pytest.fixture(scope="module")
def app_client(think_engine):
    yield from _test_client(think_engine)


@pytest.fixture
def plan(think_engine, monkeypatch):
    """`plan.tokens = [...]` makes every sequence of the next requests write those tokens where the
    model is free (tests/helpers/think_plan.py)."""
    from tests.helpers.think_plan import install_plan

    return install_plan(think_engine[1], monkeypatch)


def _engine(model: Path, max_input_tokens: int, max_total_tokens: int, max_batch_total_tokens: int):
    """(settings, engine) for a tiny model folder on CPU with these limits; the app starts the engine."""
    from opentgi.config import Settings
    from opentgi.engine.engine import Engine

    settings = Settings(model_id=str(model), device="cpu", max_input_tokens=max_input_tokens,
                        max_total_tokens=max_total_tokens, max_batch_total_tokens=max_batch_total_tokens)
    return settings, Engine.from_settings(settings)


def _test_client(settings_and_engine):
    """A test client of the whole app (every dialect) over an engine, started by its lifespan."""
    from opentgi.api.app import create_app

    settings, engine = settings_and_engine
    with create_app(settings, engine).test_client() as client:
        yield client
