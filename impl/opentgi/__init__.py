"""opentgi: a spec-first, pure-Python LLM inference server (TGI, LightLLM and SenseNova APIs)."""

__version__ = "0.1.0"
