"""An EngineClient for routes that never generate: text is one token per character."""

from __future__ import annotations

from dataclasses import dataclass, field

from opentgi.engine.errors import AdapterError, OverloadedError
from opentgi.engine.info import ChatTemplate, EngineStats, TokenizedText


@dataclass
class FakeInfo:
    model_id: str = "fake/model"
    model_sha: str | None = None
    model_dtype: str = "torch.float32"
    model_device_type: str = "cpu"
    pipeline_tag: str = "text-generation"
    max_input_tokens: int = 100
    max_total_tokens: int = 128
    max_batch_total_tokens: int = 4096
    eos_token_ids: list = field(default_factory=lambda: [0])
    vocab_size: int = 100
    adapters: list = field(default_factory=list)
    architecture: str = "LlamaForCausalLM"
    supported_architectures: list = field(default_factory=lambda: ["LlamaForCausalLM"])


class FakeEngine:
    """The EngineClient protocol, for routes that never generate: text is one token per character."""

    def __init__(self):
        self.info = FakeInfo()
        self.started = self.stopped = False

    async def start(self):
        self.started = True

    async def stop(self):
        self.stopped = True

    async def encode(self, text, add_special_tokens=True, max_tokens=None):
        return [ord(c) % 100 for c in text]

    def decode(self, token_ids, skip_special_tokens=False):
        return "".join(chr(65 + i % 26) for i in token_ids)

    async def tokenize(self, text):
        return TokenizedText([ord(c) % 100 for c in text], [(i, i + 1) for i in range(len(text))])

    async def encode_fim(self, prefix, suffix, fim_template=None):
        return await self.encode(prefix + suffix)

    def chat_template(self):
        return ChatTemplate(None)

    async def submit(self, request):
        raise OverloadedError("Model is overloaded")

    async def load_adapter(self, name, path):
        raise AdapterError("LoRA adapters are served on the paged path only")

    async def unload_adapter(self, name):
        raise AdapterError(f"adapter {name!r} is not loaded")

    def healthy(self):
        return True

    async def probe(self):
        return True

    def stats(self):
        return EngineStats(waiting=0, running=0, num_blocks=16, used_blocks=0, cached_blocks=0,
                           tokens_held_running=0, peak_tokens_running=0, preemptions_total=0,
                           prefix_hit_tokens=0, prefix_query_tokens=0, steps_total=0, last_step_at=0.0)


class ScriptedEngine(FakeEngine):
    def __init__(self, *, submit_error=None, handle=None):
        super().__init__()
        self.submit_error = submit_error
        self.handle = handle
        self.submitted = []

    async def encode(self, text, add_special_tokens=True, max_tokens=None):
        return [1] * max(1, len(text) // 4)

    async def submit(self, request):
        self.submitted.append(request)
        if self.submit_error is not None:
            raise self.submit_error
        return self.handle


