"""min_p on TGI's /generate parameters (an extension) and the OpenAI routes (vLLM's field)."""

from __future__ import annotations

import pytest

from opentgi.api.openai.params import OpenAILimits, sampling_params
from opentgi.engine.errors import ValidationError


def test_generate_takes_min_p_and_refuses_it_out_of_range(client):
    ok = client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2, "min_p": 0.1, "seed": 3}})
    assert ok.status_code == 200, ok.text
    bad = client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2, "min_p": 1.5}})
    assert bad.status_code == 422


def test_openai_routes_take_min_p(client):
    chat = client.post("/v1/chat/completions", json={"model": "tgi", "messages": [{"role": "user", "content": "x"}],
                                                     "max_tokens": 2, "min_p": 0.2})
    assert chat.status_code == 200, chat.text
    completion = client.post("/v1/completions", json={"model": "tgi", "prompt": "x", "max_tokens": 2, "min_p": 0.2})
    assert completion.status_code == 200, completion.text


def test_openai_min_p_reaches_the_engine_and_is_checked():
    limits = OpenAILimits(4, 5, 4, 100, 128, 1000)
    sampling = sampling_params(temperature=None, top_p=None, frequency_penalty=None, presence_penalty=None,
                               seed=None, logit_bias=None, limits=limits, min_p=0.25)
    assert sampling.min_p == 0.25 and sampling.do_sample
    with pytest.raises(ValidationError, match="min_p"):
        sampling_params(temperature=None, top_p=None, frequency_penalty=None, presence_penalty=None, seed=None,
                        logit_bias=None, limits=limits, min_p=-0.5)


def test_tgi_min_p_reaches_the_engine_and_samples():
    from opentgi.api.tgi.params import Limits, check_parameters
    from opentgi.schemas.tgi import GenerateParameters

    limits = Limits(max_best_of=2, max_stop_sequences=4, max_top_n_tokens=5, max_input_tokens=100,
                    max_total_tokens=128)
    checked = check_parameters("Hi", GenerateParameters(min_p=0.3), limits)
    assert checked.sampling.min_p == pytest.approx(0.3) and checked.sampling.do_sample
