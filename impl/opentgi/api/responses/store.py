"""The stored responses behind `GET` / `DELETE /v1/responses/{id}` and `previous_response_id`:
bounded by count (`--responses-store-size`), least recently used first out, in memory only.

Each entry keeps the response object as answered and the conversation that led to it in OpenAI
chat form (earlier turns, this turn's input and its output; never the `instructions`, which OpenAI
does not carry over). A follow-up's prompt is that conversation plus its new input, so its templated
prefix is the previous prompt's and lands in the engine's prefix cache.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_SIZE = 1000


@dataclass
class StoredResponse:
    response: dict  # the Response object (JSON) as answered
    conversation: list[dict] = field(default_factory=list)  # OpenAI chat messages, instructions excluded


class ResponseStore:
    def __init__(self, max_size: int = DEFAULT_SIZE):
        if max_size < 0:
            raise ValueError("the response store's size must be >= 0")
        self.max_size = max_size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Keep `entry`, evicting the least recently used ones past the size (size 0 keeps nothing)."""
        if self.max_size == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
