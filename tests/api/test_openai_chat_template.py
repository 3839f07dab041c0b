"""Chat template rendering for /v1/chat/completions (opentgi.api.chat_template)."""

from __future__ import annotations

import pytest

from opentgi.api.chat_template import DEFAULT_TOOL_PROMPT, normalize_messages, render_chat, select_template
from opentgi.engine.errors import TemplateError, ValidationError

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}]


def test_smollm2_template_renders_with_generation_prompt(smollm2_tokenizer):
    text = render_chat(smollm2_tokenizer.chat_template, [{"role": "user", "content": "Hi"}],
                       bos_token=smollm2_tokenizer.bos_token, eos_token=smollm2_tokenizer.eos_token)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                    "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_multi_part_text_is_joined():
    text = render_chat(CHATML, [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}])
    assert "<|im_start|>user\nab<|im_end|>" in text


def test_image_part_on_text_model_is_a_validation_error():
    with pytest.raises(ValidationError, match="image_url.*text only"):
        render_chat(CHATML, [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])


def test_raise_exception_is_a_template_error():
    template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        render_chat(template, [{"role": "user", "content": "x"}])


def test_syntax_error_and_missing_template_are_template_errors():
    with pytest.raises(TemplateError):
        render_chat("{% for %}", [{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="template not found"):
        render_chat(None, [{"role": "user", "content": "x"}])


def test_undefined_attribute_access_is_a_template_error():
    with pytest.raises(TemplateError):
        render_chat("{{ messages[5].content.upper() }}", [{"role": "user", "content": "x"}])


def test_sandbox_blocks_unsafe_access():
    with pytest.raises(TemplateError):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "x"}])


def test_tools_reach_a_template_that_uses_them():
    template = "{% for t in tools %}{{ t.function.name }}|{% endfor %}{{ messages[0].content }}"
    assert render_chat(template, [{"role": "user", "content": "q"}], tools=TOOLS) == "get_weather|q"


def test_tools_are_appended_when_template_ignores_them():
    text = render_chat(CHATML, [{"role": "user", "content": "weather in Paris?"}], tools=TOOLS)
    assert "weather in Paris?\n---\n" + DEFAULT_TOOL_PROMPT in text
    assert '"name":"get_weather"' in text


def test_tojson_keeps_unicode_and_bos_eos_are_passed():
    template = "{{ bos_token }}{{ messages[0] | tojson }}{{ eos_token }}"
    assert render_chat(template, [{"role": "user", "content": "é"}], bos_token="<s>", eos_token="</s>") == \
        '<s>{"role": "user", "content": "é"}</s>'


def test_named_templates_pick_default_or_tool_use():
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    assert select_template(named, with_tools=False) == "D"
    assert select_template(named, with_tools=True) == "T"
    with pytest.raises(TemplateError, match="default"):
        select_template({"rag": "R"}, with_tools=False)


def test_assistant_tool_calls_get_object_arguments_and_empty_content():
    msgs = normalize_messages([
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ])
    assert msgs[1]["content"] == ""
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert msgs[2]["tool_call_id"] == "call_1"


def test_empty_messages_are_rejected():
    with pytest.raises(ValidationError):
        render_chat(CHATML, [])
