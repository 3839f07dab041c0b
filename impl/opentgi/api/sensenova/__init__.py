"""SenseNova's text completion API (openapi/sensenova.yaml)."""
