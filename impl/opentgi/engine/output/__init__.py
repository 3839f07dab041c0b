"""Output: incremental detokenization, stop conditions, and what a step's tokens become for the client."""
