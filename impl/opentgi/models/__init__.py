"""Model code, attention backends and weight loading. Knows nothing of HTTP, APIs or scheduling."""
