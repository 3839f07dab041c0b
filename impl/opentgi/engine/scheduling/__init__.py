"""Scheduling: which sequences run each step, their KV blocks and what each row of a step does."""
