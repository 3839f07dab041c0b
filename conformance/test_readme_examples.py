"""Every curl example in README.md, parsed from the file and sent to a live server on the default model
(SmolLM2-135M-Instruct): each answers 200, or the status its `# answers NNN` comment states, and an
example whose comment states an answer (`# answers "…"`) gets exactly that text back."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
README_BASE = "localhost:8080"


@dataclass
class CurlExample:
    line: int  # where the command starts in README.md
    command: str
    url: str = ""
    method: str = "GET"
    headers: dict = field(default_factory=dict)
    data: str | None = None
    stream: bool = False  # -N: read it as an event stream
    expected_status: int = 200
    expected_answer: str | None = None


def parse_curl(line: int, command: str) -> CurlExample:
    """One curl command line (continuations joined) -> what it sends; an option not understood here fails."""
    code, _, comment = command.partition("  # ")
    example = CurlExample(line, command)
    words = shlex.split(code)
    assert words[0] == "curl", command
    i = 1
    while i < len(words):
        word = words[i]
        i += 1
        if word in ("-H", "--header"):
            name, _, value = words[i].partition(":")
            example.headers[name.strip()] = value.strip()
            i += 1
        elif word in ("-d", "--data", "--data-raw"):
            example.data, example.method = words[i], "POST"
            i += 1
        elif word in ("-X", "--request"):
            example.method = words[i]
            i += 1
        elif word in ("-N", "--no-buffer"):
            example.stream = True
        elif word in ("-i", "--include", "-s", "--silent"):
            pass  # how curl prints the answer, not what it sends
        elif word.startswith("-"):
            raise AssertionError(f"README.md:{line}: curl option {word} is not understood by this test")
        else:
            assert not example.url, f"README.md:{line}: two URLs"
            example.url = word
    if answer := re.search(r'answers (\d{3})\b', comment):
        example.expected_status = int(answer.group(1))
    elif answer := re.search(r'answers ("(?:[^"\\]|\\.)*")', comment):
        example.expected_answer = json.loads(answer.group(1))
    return example


def readme_examples() -> list[CurlExample]:
    examples, in_block, pending, start = [], False, "", 0
    for number, text in enumerate(README.read_text(encoding="utf-8").splitlines(), 1):
        if text.startswith("```"):  # any fenced block: bash, sh, console or none
            in_block = not in_block
            continue
        if not in_block:
            continue
        if not pending and not text.startswith("curl "):
            continue
        start = start if pending else number
        if text.endswith("\\"):
            pending += text[:-1]
            continue
        examples.append(parse_curl(start, pending + text))
        pending = ""
    return examples


EXAMPLES = readme_examples()


def test_the_readme_has_examples_and_they_parse():
    assert len(EXAMPLES) >= 15
    chat = next(e for e in EXAMPLES if e.url.endswith("/v1/chat/completions"))
    assert json.loads(chat.data)["temperature"] == 0
    assert chat.expected_answer == "The capital of France is Paris."
    assert any(e.url.endswith("/v1/messages") for e in EXAMPLES)
    assert any(e.url.endswith("/v1/responses") for e in EXAMPLES)


def answer_text(body) -> str:
    """The generated text in any of the README's response shapes."""
    if isinstance(body, list):
        body = body[0]
    if body.get("type") == "message":  # Anthropic Messages
        return "".join(block["text"] for block in body["content"] if block["type"] == "text")
    if body.get("object") == "response":  # OpenAI Responses
        return "".join(part["text"] for item in body["output"] if item["type"] == "message"
                       for part in item["content"])
    if "generated_text" in body:
        text = body["generated_text"]
        return text[0] if isinstance(text, list) else text
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.slow
def test_readme_curl_examples_on_the_default_model(default_server):
    failures = []
    with httpx.Client(timeout=300) as client:
        for example in EXAMPLES:
            url = "http://" + example.url.removeprefix("http://").replace(
                README_BASE, default_server.removeprefix("http://"), 1)
            response = client.request(example.method, url, headers=example.headers,
                                      content=example.data.encode() if example.data is not None else None)
            where = f"README.md:{example.line} {example.method} {example.url}"
            if response.status_code != example.expected_status:
                failures.append(f"{where}: {response.status_code} {response.text[:300]}")
            elif example.stream and not response.text.startswith(("data:", "event: ")):
                failures.append(f"{where}: not an event stream: {response.text[:300]}")
            elif example.expected_answer is not None:
                got = answer_text(response.json())
                if got != example.expected_answer:
                    failures.append(f"{where}: answered {got!r}, the README says {example.expected_answer!r}")
    assert not failures, "\n".join(failures)
