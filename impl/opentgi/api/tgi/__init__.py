"""TGI 2.1's HTTP API (openapi/tgi.json): handlers, parameter semantics, response shapes."""
