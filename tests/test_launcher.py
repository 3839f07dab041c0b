"""`text-generation-launcher`: TGI's flag names and variables become `opentgi serve` arguments; a TGI flag
opentgi does not serve, or an unknown one, is refused with its name."""

import pytest

from opentgi.cli import OPTIONS, build_parser, settings_from
from opentgi.launcher import ALREADY_SO, TGI_FLAGS, Refused, main, translate

SERVED = {option.flag for option in OPTIONS}
# TGI's flags opentgi neither serves nor already behaves like (`--sharded` has its own test).
REFUSED = sorted(set(TGI_FLAGS) - SERVED - ALREADY_SO - {"--max-input-length", "--sharded"})


def settings(argv, environ=None):
    environ = environ or {}
    return settings_from(build_parser().parse_args(["serve", *translate(argv, environ)]), environ)


def test_tgi_flags_become_settings():
    got = settings(["--model-id", "/models/x", "-p", "8081", "--max-input-length", "100",
                    "--max-total-tokens=200", "--trust-remote-code", "--json-output",
                    "--disable-usage-stats", "--sharded", "false", "--disable-crash-reports"])
    assert (got.model_id, got.port, got.max_input_tokens, got.max_total_tokens) == ("/models/x", 8081, 100, 200)
    assert got.trust_remote_code and got.json_output


def test_tgi_default_port_unless_given():
    assert settings([]).port == 3000
    assert settings([], {"PORT": "80"}).port == 80  # TGI's Docker image sets PORT=80
    assert settings(["--port", "8081"]).port == 8081


def test_values_that_look_like_flags_are_values():
    got = settings(["--fim-template", "-{prefix}-{suffix}-"])
    assert got.fim_template == "-{prefix}-{suffix}-"


def test_every_served_flag_passes_through():
    for option in OPTIONS:
        args = [option.flag] if option.is_switch else [option.flag, "1"]
        assert translate(args, {})[0] == "=".join(args)


@pytest.mark.parametrize("flag", REFUSED)
def test_unsupported_tgi_flag_is_refused_by_name(flag, capsys):
    with pytest.raises(SystemExit) as info:
        main([flag, "1", "--model-id", "x"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"TGI's {flag} is not supported" in err and err.startswith("text-generation-launcher:")


def test_quantize_is_passed_on():
    """TGI's --quantize / QUANTIZE reach `opentgi serve`, which takes the methods whose meaning matches
    and refuses the others by name (models/quantization/methods.py)."""
    assert "--quantize=eetq" in translate(["--quantize", "eetq"], {})
    assert translate([], {"QUANTIZE": "awq"}) == ["--port", "3000"]  # read from the environment by serve


def test_unsupported_tgi_variable_is_refused_by_name():
    with pytest.raises(Refused) as info:
        translate([], {"ROPE_SCALING": "linear"})
    assert "ROPE_SCALING='linear' is set" in info.value.message and "--rope-scaling" in info.value.message
    # other libraries read these with the same meaning; `false` is what opentgi does anyway
    translate([], {"HUGGINGFACE_HUB_CACHE": "/data", "SHARDED": "false", "DISABLE_USAGE_STATS": "true"})


def test_sharded_true_is_refused_unless_served():
    if "--sharded" in SERVED:
        assert translate(["--sharded", "true"], {})[0] == "--sharded=true"
    else:
        with pytest.raises(Refused, match="--sharded"):
            translate(["--sharded", "true"], {})


def test_unknown_flag_is_refused_by_name():
    with pytest.raises(Refused, match="unknown flag --no-such-flag"):
        translate(["--model-id", "x", "--no-such-flag=3"], {})


def test_version(capsys):
    main(["--version"])
    assert capsys.readouterr().out.startswith("text-generation-launcher (opentgi ")
