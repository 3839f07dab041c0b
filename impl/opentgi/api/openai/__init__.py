"""The OpenAI-compatible routes of TGI's document: chat completions, completions, tool calls."""
