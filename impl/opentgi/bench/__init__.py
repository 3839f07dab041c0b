"""The benchmark (`python -m opentgi.bench`, `nox -s bench`): serving throughput, engine steps, peers, speculation."""
