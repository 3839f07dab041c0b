"""The HTTP server around the dialects: auth, input limits, request context, tracing, shutdown, the chat page."""
