"""Model execution: runners (paged, generic, sharded), the KV pool and its sizing, host memory and torch threads."""
