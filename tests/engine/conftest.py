"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

from tests.helpers import tiny_models


@pytest.fixture(scope="module")
def model_path():
    # 3 query heads per kv head, as SmolLM2-135M: float32 attention on 2 threads differed there
    return tiny_models.tiny_llama_path(intermediate_size=1536, num_attention_heads=6, num_key_value_heads=2,
                                       head_dim=16)
