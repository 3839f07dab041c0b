"""The chat output parser (opentgi.api.chat): thinking, text and tool calls split on token ids,
text routed by its position even when it is shown later than its token."""

from __future__ import annotations

import json

from opentgi.api.chat import (
    ChatOutputParser,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallStart,
    parse_sequence,
)
from opentgi.api.chat.call_scanner import CallScanner
from opentgi.api.chat.markers import ThinkTokens
from opentgi.api.chat.tool_formats import FORMATS, ToolCallTokens, detect_format
from opentgi.engine.events import SequenceResult, TokenEvent
from opentgi.engine.request import FinishReason

THINK = ThinkTokens(start_id=900, end_id=901)
HERMES = ToolCallTokens(FORMATS["hermes"], opener_id=910, closer_id=911)
MISTRAL = ToolCallTokens(FORMATS["mistral"], opener_id=920, closer_id=None)
SPECIAL_TEXT = {900: "<think>", 901: "</think>", 910: "<tool_call>", 911: "</tool_call>", 920: "[TOOL_CALLS]",
                930: "<|python_tag|>"}


def events(*tokens, held=0) -> list[TokenEvent]:
    """Events for tokens given as text (an ordinary token) or an id (a special marker token). `held`:
    each token's text is shown `held` events later (as stop-string hold-back does)."""
    out, texts = [], []
    for i, tok in enumerate(tokens):
        special = isinstance(tok, int)
        texts.append("" if special else tok)
        shown = texts[i - held] if i >= held else ""
        out.append(TokenEvent(index=0, token_id=tok if special else 5, token_text=SPECIAL_TEXT.get(tok, tok)
                              if special else tok, logprob=None, special=special, text_delta=shown,
                              generated_tokens=i + 1))
    if held:
        out[-1].text_delta += "".join(texts[len(tokens) - held:])
    out[-1].finish_reason = FinishReason.EOS_TOKEN
    return out


def run(parser: ChatOutputParser, evs) -> list:
    pieces = [p for e in evs for p in parser.feed(e)]
    return pieces + parser.finish()


def joined(pieces, kind) -> str:
    return "".join(p.text for p in pieces if isinstance(p, kind))


def test_reasoning_opened_by_the_prompt_then_answer():
    pieces = run(ChatOutputParser(think=THINK, starts_in_reasoning=True),
                 events("Let me", " think.", 901, "\n\n", "Hello", "!"))
    assert joined(pieces, ReasoningDelta) == "Let me think."
    assert joined(pieces, TextDelta) == "Hello!"


def test_reasoning_the_model_opens_itself_and_text_routed_by_position():
    for held in (0, 1, 2):
        pieces = run(ChatOutputParser(think=THINK), events(900, "a", "b", 901, "c", "d", held=held))
        assert (joined(pieces, ReasoningDelta), joined(pieces, TextDelta)) == ("ab", "cd"), held


def test_think_marker_after_the_answer_began_is_text_and_no_markers_no_split():
    pieces = run(ChatOutputParser(think=THINK), events("x", 900, "y"))
    assert joined(pieces, ReasoningDelta) == "" and joined(pieces, TextDelta) == "xy"
    pieces = run(ChatOutputParser(), events("<think>", "y"))
    assert joined(pieces, TextDelta) == "<think>y"


def test_marker_that_is_no_special_token_has_its_text_dropped():
    evs = events("a", "<think>", "b", "</think>", "c")
    evs[1].token_id, evs[3].token_id = 900, 901
    pieces = run(ChatOutputParser(think=THINK), evs[:1] + evs[1:])
    # "a" began the answer: the marker is no longer an opener and stays text
    assert joined(pieces, TextDelta) == "a<think>b</think>c"
    pieces = run(ChatOutputParser(think=THINK), evs[1:])
    assert (joined(pieces, ReasoningDelta), joined(pieces, TextDelta)) == ("b", "c")
    for held in (1, 2):  # the markers' text shown later than their tokens (stop-string hold-back)
        evs = events("<think>", "b", "</think>", "c", "d", held=held)
        evs[0].token_id, evs[2].token_id = 900, 901
        pieces = run(ChatOutputParser(think=THINK), evs)
        assert (joined(pieces, ReasoningDelta), joined(pieces, TextDelta)) == ("b", "cd"), held


def test_hermes_parallel_calls_streamed_with_reasoning_first():
    calls = ['{"name": "get_weather", "arguments": {"city": "Paris"}}', '{"name": "get_time", "arguments": {}}']
    tokens = [900, "plan", 901, "\n", 910, calls[0][:20], calls[0][20:41], calls[0][41:], 911, "\n", 910,
              calls[1], 911]
    parser = ChatOutputParser(think=THINK, tool_calls=HERMES)
    pieces = run(parser, events(*tokens))
    starts = [p for p in pieces if isinstance(p, ToolCallStart)]
    assert [(s.index, s.name) for s in starts] == [(0, "get_weather"), (1, "get_time")]
    assert starts[0].id != starts[1].id and starts[0].id.startswith("call_")
    args = ["".join(p.text for p in pieces if isinstance(p, ToolCallArguments) and p.index == i) for i in (0, 1)]
    assert [json.loads(a) for a in args] == [{"city": "Paris"}, {}]
    assert len([p for p in pieces if isinstance(p, ToolCallArguments) and p.index == 0]) >= 2  # streamed
    assert joined(pieces, TextDelta) == "" and joined(pieces, ReasoningDelta) == "plan" and parser.saw_calls


def test_text_before_a_call_and_parse_sequence():
    evs = events("Sure.", 910, '{"name": "f", "arguments": {"a": [1, "}"]}}', 911)
    seq = SequenceResult(index=0, token_ids=[0] * len(evs), text="Sure.", finish_reason=FinishReason.EOS_TOKEN,
                         seed=None, tokens=evs)
    message = parse_sequence(seq, ChatOutputParser(tool_calls=HERMES))
    assert message.content == "Sure." and len(message.tool_calls) == 1
    assert message.tool_calls[0].name == "f" and json.loads(message.tool_calls[0].arguments) == {"a": [1, "}"]}


def test_mistral_array_of_calls():
    body = '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "]"}}]'
    pieces = run(ChatOutputParser(tool_calls=MISTRAL), events(920, *[body[i:i + 7] for i in range(0, len(body), 7)]))
    starts = [p.name for p in pieces if isinstance(p, ToolCallStart)]
    args = ["".join(p.text for p in pieces if isinstance(p, ToolCallArguments) and p.index == i) for i in (0, 1)]
    assert starts == ["a", "b"] and [json.loads(a) for a in args] == [{"x": 1}, {"y": "]"}]


def test_call_with_keys_in_another_order_is_parsed_whole():
    scanner = CallScanner(array=False)
    pieces = scanner.feed('{"arguments": {"q": 1}, "name": "search"}')
    assert [type(p) for p in pieces] == [ToolCallStart, ToolCallArguments] and scanner.done
    assert pieces[0].name == "search" and json.loads(pieces[1].text) == {"q": 1}


def test_cut_short_call_hands_out_what_it_has():
    pieces = run(ChatOutputParser(tool_calls=HERMES), events(910, '{"name": "f", "arguments": {"a": [1, 2'))
    assert [p.name for p in pieces if isinstance(p, ToolCallStart)] == ["f"]
    assert joined(pieces, ToolCallArguments) == '{"a": [1, 2'


def test_format_detected_from_the_template():
    assert detect_format("{% if tools %}<tool_call>{{ tools }}</tool_call>{% endif %}").name == "hermes"
    assert detect_format("[AVAILABLE_TOOLS]...[TOOL_CALLS]").name == "mistral"
    assert detect_format("<|python_tag|>").name == "llama3_json"
    assert detect_format("{{ messages }}") is None


def test_prompt_state_from_the_last_think_marker():
    assert THINK.prompt_state([5, 900]) == "open"  # Qwen3-Thinking / DeepSeek-R1: `<think>\n` ends the prompt
    assert THINK.prompt_state([5, 900, 6, 901, 7]) == "closed"  # enable_thinking=false: an empty span
    assert THINK.prompt_state([5, 6]) == "none"  # the model may open one itself


def test_llama3_bare_json_call_and_python_tag():
    llama3 = ToolCallTokens(FORMATS["llama3_json"], opener_id=930, closer_id=None)
    pieces = run(ChatOutputParser(tool_calls=llama3), events('{"name": "f", ', '"parameters": {"x": 1}}'))
    assert [p.name for p in pieces if isinstance(p, ToolCallStart)] == ["f"]
    assert json.loads(joined(pieces, ToolCallArguments)) == {"x": 1} and joined(pieces, TextDelta) == ""
    pieces = run(ChatOutputParser(tool_calls=llama3), events("Sure {not a call}"))
    assert joined(pieces, TextDelta) == "Sure {not a call}"
    pieces = run(ChatOutputParser(tool_calls=llama3), events("Sure.", 930, '{"name": "g", "parameters": {}}'))
    assert [p.name for p in pieces if isinstance(p, ToolCallStart)] == ["g"] and joined(pieces, TextDelta) == "Sure."
