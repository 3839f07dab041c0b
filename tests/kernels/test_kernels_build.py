"""Building and loading the library: into the session's temporary cache (tests/conftest.py), found
there again without compiling, registered as torch ops that torch.compile and FX can trace, and,
without a usable compiler, one line saying why the torch path serves."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch.fx.experimental.proxy_tensor import make_fx

from opentgi.kernels import build, native
from tests.helpers.gguf_blocks import random_blocks

torch.set_num_threads(1)


def test_the_library_is_found_in_the_cache_once_built(kernels, kernel_cache):
    assert kernels.name == "native" and kernels.isa in native.supported_isas()
    assert kernels.library.parent == build.cache_dir() == kernel_cache
    assert kernels.library.name.startswith("opentgi_kernels-") and kernels.library.suffix == ".so"
    again = build.build()
    assert again.cached and again.path == kernels.library
    assert not list(build.cache_dir().glob(".build-*"))  # no temporary folder left behind


@pytest.mark.slow  # a whole build: every kernel source compiled
def test_a_fresh_cache_gets_a_whole_build(monkeypatch, tmp_path):
    """A machine's first start: every source compiled and linked into the cache. Built for the
    portable variant alone (the session's own build, `kernels`, has every variant this CPU runs:
    the ops' tests load it), so the suite compiles each source once more, not twice."""
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(build, "variants", lambda: ("scalar",))
    built = build.build()
    assert not built.cached and built.path.parent == tmp_path and built.path.is_file()
    assert built.isas == ("scalar",)
    assert not list(tmp_path.glob(".build-*"))


def test_the_optional_variants_are_built_and_run_exactly_where_the_cpu_has_them(kernels, monkeypatch):
    zen3 = "flags\t\t: fpu sse2 avx avx2 fma f16c bmi2\n"
    zen5 = "flags\t\t: fpu avx2 fma f16c avx_vnni avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16\n"
    skylake_x = "flags\t\t: fpu avx2 fma f16c avx512f avx512dq avx512bw avx512vl\n"  # no VNNI
    alder_lake = "flags\t\t: fpu avx2 fma f16c avx_vnni\n"
    assert build.cpu_has(build.AVX512_CPU_FLAGS, zen5) and build.cpu_has(build.AVXVNNI_CPU_FLAGS, zen5)
    assert not build.cpu_has(build.AVX512_CPU_FLAGS, zen3) and not build.cpu_has(build.AVX512_CPU_FLAGS, skylake_x)
    assert build.cpu_has(build.AVXVNNI_CPU_FLAGS, alder_lake) and not build.cpu_has(build.AVX512_CPU_FLAGS, alder_lake)
    assert not build.cpu_has(build.AVXVNNI_CPU_FLAGS, zen3) and not build.cpu_has(build.AVXVNNI_CPU_FLAGS, skylake_x)
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(build, "cpu_has", lambda flags: False)
    assert build.variants() == ("scalar", "avx2")
    monkeypatch.setattr(build, "cpu_has", lambda flags: flags == build.AVXVNNI_CPU_FLAGS)
    assert build.variants() == ("scalar", "avx2", "avxvnni")
    monkeypatch.setattr(build, "cpu_has", lambda flags: flags == build.AVX512_CPU_FLAGS)
    assert build.variants() == ("scalar", "avx2", "avx512")
    monkeypatch.setattr(build, "cpu_has", lambda flags: True)
    assert build.variants() == ("scalar", "avx2", "avxvnni", "avx512")
    assert set(build.X86_VARIANTS) == {("scalar", "avx2"), ("scalar", "avx2", "avxvnni"), ("scalar", "avx2", "avx512"),
                                       ("scalar", "avx2", "avxvnni", "avx512")}
    monkeypatch.setattr(build.platform, "machine", lambda: "aarch64")
    assert build.variants() == ("scalar",)
    monkeypatch.undo()
    # this host: the loaded library runs each optional variant exactly where its CPU has it, and serves its best
    x86 = build.platform.machine().lower() in ("x86_64", "amd64")
    assert ("avx512" in native.supported_isas()) == (x86 and build.cpu_has(build.AVX512_CPU_FLAGS))
    assert ("avxvnni" in native.supported_isas()) == (x86 and build.cpu_has(build.AVXVNNI_CPU_FLAGS))
    assert kernels.isa == native.supported_isas()[-1]


def test_a_library_built_on_a_cpu_of_another_kind_serves(kernels, monkeypatch, tmp_path):
    """A Docker image's library, built on a CPU with other optional variants (its ops check the CPU at
    run time): found without compiling where it holds every variant this CPU runs; where it lacks
    this CPU's best one, used only when the build here fails (a read-only cache), rather than no
    library."""
    cxx = build.compiler()
    two, vnni, three, four = (("scalar", "avx2"), ("scalar", "avx2", "avxvnni"), ("scalar", "avx2", "avx512"),
                              ("scalar", "avx2", "avxvnni", "avx512"))
    every = tmp_path / f"opentgi_kernels-{build.cache_key(cxx, four)}.so"
    every.write_bytes(b"")
    for isas in (two, vnni, three):  # CPUs without AVX-512 or AVX-VNNI or either
        monkeypatch.setattr(build, "variants", lambda isas=isas: isas)
        found = build.build(tmp_path)
        assert found.cached and found.path == every and found.isas == four
    every.unlink()
    with_avx512 = tmp_path / f"opentgi_kernels-{build.cache_key(cxx, three)}.so"
    with_avx512.write_bytes(b"")
    monkeypatch.setattr(build, "variants", lambda: two)
    found = build.build(tmp_path)
    assert found.cached and found.path == with_avx512 and found.isas == three
    with_avx512.unlink()
    without = tmp_path / f"opentgi_kernels-{build.cache_key(cxx, two)}.so"
    without.write_bytes(b"")
    monkeypatch.setattr(build, "variants", lambda: three)  # a CPU with AVX-512 that cannot build here

    def refuse(jobs, parallel):
        raise build.BuildError("c++ failed on q4_k.cpp: unrecognized command-line option '-mavx512vnni'")

    monkeypatch.setattr(build, "_run_all", refuse)
    found = build.build(tmp_path)
    assert found.cached and found.path == without and found.isas == two
    without.unlink()
    with pytest.raises(build.BuildError, match="mavx512vnni"):
        build.build(tmp_path)


def test_a_compiler_that_refuses_an_optional_variant_builds_the_rest(monkeypatch, tmp_path):
    """GCC before 11 has no -mavxvnni: on a CPU with AVX-VNNI and AVX-512 the library is built
    without the AVX-VNNI variant (its CPU then runs AVX-512's), not left unbuilt."""
    monkeypatch.setattr(build, "variants", lambda: ("scalar", "avx2", "avxvnni", "avx512"))
    compiled = []

    def compile_without_avxvnni(jobs, parallel):
        if any("-mavxvnni" in job for job in jobs):
            raise build.BuildError("c++ failed on q4_k.cpp: error: unrecognized command-line option '-mavxvnni'")
        for job in jobs:
            compiled.append(job)
            Path(job[job.index("-o") + 1]).write_bytes(b"")

    monkeypatch.setattr(build, "_run_all", compile_without_avxvnni)
    built = build.build(tmp_path)
    assert not built.cached and built.isas == ("scalar", "avx2", "avx512") and built.path.is_file()
    assert any("-mavx512vnni" in job for job in compiled)


def test_the_cache_key_follows_the_sources_and_the_flags(kernels, monkeypatch):
    cxx = build.compiler()
    key = build.cache_key(cxx, build.variants())
    assert build.cache_key(cxx, ("scalar",)) != key
    monkeypatch.setattr(build, "COMMON_FLAGS", (*build.COMMON_FLAGS, "-DSOMETHING"))
    assert build.cache_key(cxx, build.variants()) != key


def test_cache_dir_honours_the_override_then_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv(build.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_dir() == tmp_path / "xdg" / "opentgi" / "kernels"
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "mine"))
    assert build.cache_dir() == tmp_path / "mine"


def test_the_op_traces_as_one_op(kernels):
    blocks = torch.from_numpy(random_blocks(Q.Q4_0, 8, 64))

    def f(x, w):
        return torch.ops.opentgi.gguf_mm(x, w, 2, 8, 0) * 2

    graph = make_fx(f, tracing_mode="fake")(torch.randn(3, 64), blocks)
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert torch.ops.opentgi.gguf_mm.default in targets
    x = torch.randn(3, 64)
    assert torch.equal(graph(x, blocks), f(x, blocks))


def test_without_a_compiler_the_torch_path_serves_and_says_why(tmp_path):
    env = {**os.environ, "CXX": "/nonexistent", build.CACHE_ENV: str(tmp_path)}
    code = ("import logging; logging.basicConfig(level=logging.INFO, format='%(message)s');"
            "from opentgi.kernels import native; print(native.load('auto').describe())")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "torch (no C++ compiler (CXX='/nonexistent' not found))"
    lines = [line for line in done.stderr.splitlines() if line.startswith("kernels:")]
    assert lines == ["kernels: torch path serves GGUF layers (no C++ compiler (CXX='/nonexistent' not found))"]
    assert list(tmp_path.iterdir()) == []


def test_native_mode_refuses_to_fall_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "/nonexistent")
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    with pytest.raises(build.BuildError, match="no C\\+\\+ compiler"):
        build.build()
    monkeypatch.setattr(native, "_loaded", [])  # as in a fresh process
    with pytest.raises(native.KernelsUnavailable, match="no C\\+\\+ compiler"):
        native.load("native")
    assert native.load("torch").describe() == "torch (--kernels torch)"


def test_the_kernels_flag_and_the_build_subcommand(kernels, capsys):
    from opentgi.cli import build_parser, main, settings_from

    def settings(*flags, environ=None):
        return settings_from(build_parser().parse_args(["serve", *flags]), environ or {})

    assert settings().kernels == "auto"
    assert settings("--kernels", "torch").kernels == "torch"
    assert settings(environ={"KERNELS": "native"}).kernels == "native"
    with pytest.raises(SystemExit, match="--kernels must be auto, native or torch"):
        settings("--kernels", "fast")
    main(["kernels", "build"])
    printed = capsys.readouterr().out
    assert str(kernels.library) in printed and f"native ({kernels.isa})" in printed


def test_two_processes_starting_at_once_compile_once(monkeypatch, tmp_path):
    """Concurrent builds of one key wait for each other: one compiles, the other finds its file."""
    import threading

    links = []

    def fake_run_all(jobs, parallel):
        for command in jobs:
            if "-shared" in command:
                links.append(command)
                time.sleep(0.2)  # a build long enough for the other caller to arrive
                Path(command[command.index("-o") + 1]).write_bytes(b"library")

    monkeypatch.setattr(build, "_run_all", fake_run_all)
    results = []
    callers = [threading.Thread(target=lambda: results.append(build.build(tmp_path))) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(links) == 1
    assert sorted(r.cached for r in results) == [False, True] and results[0].path == results[1].path


def test_compile_jobs_report_the_first_error_and_never_stall_on_output():
    """`_run_all`: a job printing more than a pipe holds still finishes; a failing one raises
    BuildError with its first error line, naming the source."""
    chatty = ["sh", "-c", "head -c 300000 /dev/zero | tr '\\0' x; exit 0", "big.cpp", "-o", "big.o"]
    build._run_all([chatty, ["true"], ["true"]], 2)
    failing = ["sh", "-c", "echo 'note: context'; echo 'bad.cpp:3:1: error: expected ;'; exit 1", "bad.cpp",
               "-o", "bad.o"]
    with pytest.raises(build.BuildError, match=r"sh failed on bad.cpp: bad.cpp:3:1: error: expected ;"):
        build._run_all([["true"], failing, chatty], 2)
