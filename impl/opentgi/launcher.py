"""`text-generation-launcher`: `opentgi serve` under TGI's launcher name, for scripts, Dockerfiles and
systemd units written for TGI 2.1.2.

The flags are `opentgi serve`'s own (opentgi.cli.OPTIONS: TGI's names and environment variables, plus
opentgi's extras), so a flag added there is accepted here too. On top of that it takes TGI's spellings
(`-p` for `--port`, `--max-input-length`) and TGI's default port (3000). A TGI flag opentgi does not
support is refused with a message naming it, whether given as a flag or set in the environment; a
flag neither knows is refused as unknown. Nothing is silently ignored.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

PROG = "text-generation-launcher"
TGI_DEFAULT_PORT = 3000

# Every flag of TGI 2.1.2's launcher (`text-generation-launcher --help`), with its environment variable
# (None: the flag has none). Those opentgi serves are found in opentgi.cli.OPTIONS; the others are refused.
TGI_FLAGS: dict[str, str | None] = {
    flag: None if flag == "--env" else flag[2:].replace("-", "_").upper()
    for flag in (
        "--model-id", "--revision", "--validation-workers", "--sharded", "--num-shard", "--quantize",
        "--speculate", "--dtype", "--trust-remote-code", "--max-concurrent-requests", "--max-best-of",
        "--max-stop-sequences", "--max-top-n-tokens", "--max-input-tokens", "--max-input-length",
        "--max-total-tokens", "--waiting-served-ratio", "--max-batch-prefill-tokens",
        "--max-batch-total-tokens", "--max-waiting-tokens", "--max-batch-size", "--cuda-graphs",
        "--hostname", "--port", "--shard-uds-path", "--master-addr", "--master-port",
        "--huggingface-hub-cache", "--weights-cache-override", "--disable-custom-kernels",
        "--cuda-memory-fraction", "--rope-scaling", "--rope-factor", "--json-output", "--otlp-endpoint",
        "--otlp-service-name", "--cors-allow-origin", "--watermark-gamma", "--watermark-delta", "--ngrok",
        "--ngrok-authtoken", "--ngrok-edge", "--tokenizer-config-path", "--disable-grammar-support",
        "--env", "--max-client-batch-size", "--lora-adapters", "--disable-usage-stats",
        "--disable-crash-reports",
    )
}
# TGI's other spellings of flags opentgi serves.
ALIASES = {"-p": "--port", "--max-input-length": "--max-input-tokens"}
# Switches asking for what opentgi always does: it sends no usage statistics and no crash reports.
ALREADY_SO = frozenset({"--disable-usage-stats", "--disable-crash-reports"})
# Variables other libraries read with the same meaning whatever the launcher does (huggingface_hub's
# cache, torch.distributed's rendezvous): set in an environment, they are not a request to refuse.
HONOURED_ELSEWHERE = frozenset({"HUGGINGFACE_HUB_CACHE", "MASTER_ADDR", "MASTER_PORT"})


class Refused(SystemExit):
    def __init__(self, message: str):
        super().__init__(2)
        self.message = f"{PROG}: {message}"

    def __str__(self) -> str:
        return self.message


def _serve_flags() -> dict[str, bool]:
    """Every option string of `opentgi serve` (read from the parser the CLI builds) -> takes a value."""
    import argparse

    from opentgi.cli import add_serve_options

    parser = argparse.ArgumentParser(add_help=False)
    add_serve_options(parser)
    return {flag: action.nargs != 0 for flag, action in parser._option_string_actions.items()}


def _unsupported(flag: str) -> str:
    return (f"TGI's {flag} is not supported by opentgi (see docs/differences-from-tgi.md for the "
            "flags it takes)")


def translate(argv: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """TGI launcher arguments -> `opentgi serve` arguments; raises Refused for anything not served."""
    served = _serve_flags()
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if not token.startswith("-") or token == "-":
            out.append(token)
            continue
        name, eq, value = token.partition("=")
        name = ALIASES.get(name, name)
        if name in ALREADY_SO:
            continue
        if name == "--sharded" and name not in served:  # `--sharded false`: one process, as opentgi runs
            if not eq and i < len(args):
                value = args[i]
                i += 1
            if value.strip().lower() == "false":
                continue
            raise Refused(f"{_unsupported(name)}, only `--sharded false`")
        if name in served:
            if served[name] and not eq and i < len(args):  # its value, whatever it looks like
                eq, value = "=", args[i]
                i += 1
            out.append(name + eq + value)
        elif name in ("-h", "--help"):
            out.append(name)
        elif name in TGI_FLAGS:
            raise Refused(_unsupported(name))
        else:
            raise Refused(f"unknown flag {name} (neither TGI's launcher nor opentgi has it; "
                          f"`{PROG} --help` lists the flags)")
    for flag, env in TGI_FLAGS.items():
        if (env and environ.get(env) and flag not in served and flag not in ALREADY_SO
                and env not in HONOURED_ELSEWHERE
                and not (flag == "--sharded" and environ[env].strip().lower() == "false")):
            raise Refused(f"{env}={environ[env]!r} is set: {_unsupported(flag)}; unset it")
    if "--port" not in {a.partition("=")[0] for a in out} and not environ.get("PORT"):
        out += ["--port", str(TGI_DEFAULT_PORT)]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    from opentgi import __version__
    from opentgi.cli import main as opentgi_main

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-V", "--version"):
        print(f"{PROG} (opentgi {__version__})")
        return
    try:
        serve_args = translate(args, os.environ)
    except Refused as refused:
        print(refused.message, file=sys.stderr)
        raise
    if "-h" in serve_args or "--help" in serve_args:
        print(f"{PROG}: opentgi's TGI-compatible launcher: `opentgi serve` with TGI's flag names and "
              f"environment variables (-p for --port, --max-input-length, default port {TGI_DEFAULT_PORT}).\n")
    opentgi_main(["serve", *serve_args])


if __name__ == "__main__":
    main()
