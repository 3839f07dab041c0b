"""The launcher's flags and environment variables become one Settings object."""

import pytest

from opentgi.cli import build_parser, settings_from


def parse(argv, environ=None):
    return settings_from(build_parser().parse_args(["serve", *argv]), environ or {})


def test_defaults_match_tgi_launcher():
    settings = parse([])
    assert settings.model_id is None
    assert settings.port == 8080
    assert settings.max_concurrent_requests == 128
    assert settings.max_best_of == 2
    assert settings.max_stop_sequences == 4
    assert settings.max_top_n_tokens == 5
    assert settings.api == "tgi"


def test_flags_fill_settings():
    settings = parse(["--model-id", "/models/x", "--port", "9000", "--max-input-tokens", "100",
                      "--max-total-tokens", "200", "--json-output", "--dtype", "bfloat16",
                      "--num-threads", "1", "--max-batch-total-tokens", "4096"])
    assert (settings.model_id, settings.port, settings.max_input_tokens) == ("/models/x", 9000, 100)
    assert (settings.max_total_tokens, settings.json_output, settings.dtype) == (200, True, "bfloat16")
    assert (settings.num_threads, settings.max_batch_total_tokens) == (1, 4096)


def test_environment_variables_like_tgi_and_flag_wins():
    env = {"MODEL_ID": "env-model", "PORT": "7000", "MAX_INPUT_LENGTH": "50", "JSON_OUTPUT": "true",
           "MAX_BEST_OF": "3", "SPECULATE": "3"}
    settings = parse(["--port", "7001"], env)
    assert settings.speculate == 3
    assert parse(["--speculate", "5"], env).speculate == 5
    assert settings.model_id == "env-model"
    assert settings.port == 7001
    assert settings.max_input_tokens == 50  # TGI's legacy name still works
    assert settings.json_output is True
    assert settings.max_best_of == 3


def test_switches_and_renamed_fields(tmp_path):
    words = tmp_path / "words.txt"
    words.write_text("alpha\n\n beta \n", encoding="utf-8")
    settings = parse(["--disable-prefix-caching", "--chunked-prefill-tokens", "0",
                      "--sensitive-words", str(words), "--api", "lightllm"])
    assert settings.enable_prefix_caching is False
    assert settings.chunked_prefill_tokens is None
    assert settings.sensitive_words == ["alpha", "beta"]
    assert settings.api == "lightllm"


@pytest.mark.parametrize("argv,env", [(["--api", "grpc"], {}), ([], {"PORT": "eighty"}),
                                      (["--fim-template", "<PRE>{prefix}<MID>"], {}),
                                      (["--speculate", "-1"], {}), (["--reasoning-budget", "-1"], {}),
                                      (["--tool-call-parser", "xml"], {}), (["--kv-cache-dtype", "fp8"], {}),
                                      ([], {"KV_CACHE_DTYPE": "half"})])
def test_bad_values_exit_with_a_message(argv, env):
    with pytest.raises(SystemExit) as info:
        parse(argv, env)
    assert "opentgi:" in str(info.value)


def test_kv_cache_dtype_flag_and_environment():
    assert parse([]).kv_cache_dtype == "auto"
    assert parse(["--kv-cache-dtype", "float32"]).kv_cache_dtype == "float32"
    assert parse([], {"KV_CACHE_DTYPE": "bfloat16"}).kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit, match="--kv-cache-dtype must be one of auto, float16, bfloat16, float32, got 'fp8'"):
        parse(["--kv-cache-dtype", "fp8"])


def test_fim_template_is_kept_when_valid():
    template = "<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>"
    assert parse(["--fim-template", template]).fim_template == template


def test_serve_freezes_what_start_up_built_before_serving(monkeypatch):
    """Objects built before serving go to the collector's permanent generation (a full collection
    would otherwise walk the model and the app while holding the GIL)."""
    import gc
    from types import SimpleNamespace

    import opentgi.api.app
    import opentgi.api.server.shutdown
    from opentgi import cli
    from opentgi.config import Settings
    from opentgi.engine.engine import Engine

    seen = {}

    class FakeEngine:
        info = SimpleNamespace(model_id="fake")

    class FakeApp:
        server_state = SimpleNamespace(drain=None)

    class FakeServer:
        def __init__(self, config, drain, shutdown_timeout):
            pass

        def run(self):
            seen["frozen"] = gc.get_freeze_count()

    monkeypatch.setattr(Engine, "from_settings", staticmethod(lambda settings, observer=None: FakeEngine()))
    monkeypatch.setattr(opentgi.api.app, "create_app", lambda settings, engine, metrics=None: FakeApp())
    monkeypatch.setattr(opentgi.api.server.shutdown, "GracefulServer", FakeServer)
    try:
        cli.serve(Settings(model_id="unused"))
    finally:
        gc.unfreeze()
    assert seen["frozen"] > 1000



def test_serve_loads_the_model_while_it_imports_the_http_side(monkeypatch):
    """The engine is built in another thread while serve's own thread imports the HTTP stack."""
    import threading
    from types import SimpleNamespace

    import opentgi.api.app
    import opentgi.api.server.shutdown
    from opentgi import cli
    from opentgi.config import Settings
    from opentgi.engine.engine import Engine

    imported = threading.Event()
    seen = {}
    import_http_side = cli._import_http_side

    def importing():
        import_http_side()
        imported.set()

    def loading(settings, observer=None):
        seen["overlapped"] = imported.wait(10)  # serve's thread imports meanwhile
        seen["thread"] = threading.current_thread().name
        return SimpleNamespace(info=SimpleNamespace(model_id="fake"))

    class FakeServer:
        def __init__(self, config, drain, shutdown_timeout):
            pass

        def run(self):
            pass

    monkeypatch.setattr(cli, "_import_http_side", importing)
    monkeypatch.setattr(Engine, "from_settings", staticmethod(loading))
    monkeypatch.setattr(opentgi.api.app, "create_app",
                        lambda settings, engine, metrics=None: SimpleNamespace(server_state=SimpleNamespace(drain=None)))
    monkeypatch.setattr(opentgi.api.server.shutdown, "GracefulServer", FakeServer)
    monkeypatch.setattr(cli, "freeze_startup_objects", lambda: None)
    cli.serve(Settings(model_id="unused"))
    assert seen == {"overlapped": True, "thread": seen["thread"]}
    assert seen["thread"] != threading.main_thread().name

def test_chat_flags(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("k1\n\n k2 \n", encoding="utf-8")
    settings = parse(["--chat-template-kwargs", '{"enable_thinking": false}', "--reasoning-budget", "64",
                      "--tool-call-parser", "hermes", "--cors-allow-origin", "https://a.example,https://b.example",
                      "--api-key-file", str(keys)])
    assert settings.chat_template_kwargs == {"enable_thinking": False}
    assert (settings.reasoning_budget, settings.tool_call_parser) == (64, "hermes")
    assert settings.cors_allow_origin == "https://a.example,https://b.example"
    assert settings.api_keys == ["k1", "k2"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--chat-template-kwargs", "[1]"])
