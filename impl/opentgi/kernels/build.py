"""Compiling csrc/ into one shared library of torch ops, once per machine, and loading it.

The library is built with the machine's C++ compiler (`$CXX`, else `c++`): the kernel sources
once per instruction set: a portable scalar variant and, on x86-64, an AVX2+FMA+F16C one, where
the CPU has AVX-VNNI an AVX2 one with its 256-bit dot products (`avxvnni`: Intel's cores without
AVX-512), and where it has AVX-512 F/BW/VL/DQ with VNNI an AVX-512 one (the op picks per call, the
loader picks the best the CPU has; every variant computes the same bits); a variant the compiler
cannot build (no `-mavxvnni` before GCC 11) is left out with the rest built. Plus ops.cpp,
moe_ops.cpp and stack.cpp, the only sources that include
torch's headers (`<torch/library.h>`, `<ATen/Parallel.h>`: the ops run in torch's intra-op pool).
Those three are compiled as one translation unit, started first: parsing torch's headers is most
of their time, so once instead of three times halves the build. The rest are compiled side by side
on the machine's cores. It is cached under `cache_dir()` as
`opentgi_kernels-<key>.so`, the key a hash of the sources, the compiler's version, the flags and
torch's version and C++ ABI; it is linked under a temporary name and renamed into place, so two
processes building at once both end with a whole file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SOURCES = Path(__file__).resolve().parent / "csrc"
MATMUL_SOURCES = ("quantize.cpp", "q4_0_q4_1_q8_0.cpp", "q4_k.cpp", "q6_k.cpp",
                  "q5_0_q5_1.cpp", "q5_k.cpp", "q2_k_q3_k.cpp", "iq4.cpp", "dense.cpp", "blocks_bf16.cpp")
KERNEL_SOURCES = (*MATMUL_SOURCES, "attention.cpp", "prompt_attention.cpp", "layer_ops.cpp")
# the AVX-VNNI variant is the matmuls' alone, the AVX-512 one the matmuls', decode attention's and
# the row ops': prompt attention runs AVX2's there
ISA_SOURCES = {"avxvnni": MATMUL_SOURCES, "avx512": (*MATMUL_SOURCES, "attention.cpp", "layer_ops.cpp")}
COMMON_FLAGS = ("-O3", "-fPIC", "-ffp-contract=off", "-fno-math-errno")
ISA_FLAGS = {"scalar": (), "avx2": ("-mavx2", "-mfma", "-mf16c"),
             "avxvnni": ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
             "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                        "-mavx512vnni")}
AVXVNNI_CPU_FLAGS = ("avx_vnni",)  # /proc/cpuinfo's names
AVX512_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")
OPTIONAL = ("avxvnni", "avx512")  # the variants only some x86-64 CPUs (and compilers) have
# what variants() builds on x86-64: scalar and AVX2, with either, both or neither optional one
X86_VARIANTS = (("scalar", "avx2"), ("scalar", "avx2", "avxvnni"), ("scalar", "avx2", "avx512"),
                ("scalar", "avx2", "avxvnni", "avx512"))
TORCH_SOURCES = ("ops.cpp", "moe_ops.cpp", "stack.cpp")  # the torch ops: one translation unit (torch's headers once)
CACHE_ENV = "OPENTGI_KERNELS_CACHE"
BUILD_TIMEOUT_S = 300


class BuildError(RuntimeError):
    """The library could not be built; the message says why in one line."""


@dataclass
class Built:
    path: Path
    isas: tuple[str, ...]
    seconds: float
    cached: bool  # found already built


def cache_dir() -> Path:
    """`$OPENTGI_KERNELS_CACHE`, else `$XDG_CACHE_HOME/opentgi/kernels`, else `~/.cache/opentgi/kernels`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "opentgi" / "kernels"


def compiler() -> str:
    """The compiler's path; BuildError when `$CXX` (or `c++`) is not an executable."""
    name = os.environ.get("CXX") or "c++"
    found = shutil.which(name)
    if found is None:
        raise BuildError(f"no C++ compiler (CXX={name!r} not found)")
    return found


def variants() -> tuple[str, ...]:
    """The variants to compile here: scalar everywhere; AVX2 on any x86-64 (a library built on one
    host may be loaded on another; the op checks the CPU at run time); AVX-VNNI and AVX-512 only
    where this CPU has them, so a host compiles only what it can run and test."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("scalar",)
    return ("scalar", "avx2", *(["avxvnni"] if cpu_has(AVXVNNI_CPU_FLAGS) else []),
            *(["avx512"] if cpu_has(AVX512_CPU_FLAGS) else []))


def cpu_has(flags: tuple[str, ...], cpuinfo: str | None = None) -> bool:
    """Whether the CPU lists every flag in `cpuinfo` (Linux /proc/cpuinfo's text; read when None,
    False where it is not readable)."""
    try:
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(flags) <= set(line.split(":", 1)[1].split())
    return False


def _torch_flags() -> tuple[list[str], list[str]]:
    import torch

    root = Path(torch.__file__).resolve().parent
    compile_flags = [f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
                     f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-fopenmp",
                     "-std=c++20"]
    link_flags = [f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}", "-fopenmp"]
    return compile_flags, link_flags


def _jobs(cxx: str, out: Path, isas: tuple[str, ...]) -> list[list[str]]:
    """The compile commands, the longest first (the torch ops' one translation unit, written into
    `out`), so the kernel sources fill the other cores meanwhile."""
    include = f"-I{SOURCES}"
    torch_compile, _ = _torch_flags()
    defines = [f"-DOPENTGI_WITH_{isa.upper()}" for isa in isas if isa != "scalar"]
    unit = out / "torch_ops.cpp"
    unit.write_text("".join(f'#include "{source}"\n' for source in TORCH_SOURCES))
    jobs = [[cxx, *COMMON_FLAGS, *torch_compile, *defines, include, "-w", "-c", str(unit),
             "-o", str(out / "torch_ops.o")]]
    for isa in isas:
        for source in ISA_SOURCES.get(isa, KERNEL_SOURCES):
            obj = out / f"{Path(source).stem}.{isa}.o"
            jobs.append([cxx, *COMMON_FLAGS, "-std=c++17", *ISA_FLAGS[isa], include, "-c",
                         str(SOURCES / source), "-o", str(obj)])
    return jobs


def cache_key(cxx: str, isas: tuple[str, ...]) -> str:
    import torch

    digest = hashlib.sha256()
    for source in sorted(SOURCES.iterdir()):
        if source.suffix in (".cpp", ".h"):
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    compile_flags, link_flags = _torch_flags()
    for part in (version, torch.__version__, *COMMON_FLAGS, *compile_flags, *link_flags, *isas,
                 *(f for isa in isas for f in ISA_FLAGS[isa])):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def build(directory: Path | None = None) -> Built:
    """The library's path, compiled into `directory` (default `cache_dir()`) unless already there.
    Where the compiler refuses an optional variant's flags, the variants without it are built."""
    start = time.perf_counter()
    cxx = compiler()
    isas = variants()
    directory = Path(directory) if directory is not None else cache_dir()
    while True:
        try:
            return _build(cxx, isas, directory, start)
        except BuildError as exc:
            dropped = next((v for v in reversed(isas) if v in OPTIONAL
                            and any(f in str(exc) for f in set(ISA_FLAGS[v]) - set(ISA_FLAGS["avx2"]))), None)
            if dropped is None:
                raise
            isas = tuple(v for v in isas if v != dropped)


def _build(cxx: str, isas: tuple[str, ...], directory: Path, start: float) -> Built:
    try:
        key = cache_key(cxx, isas)
        # the other x86-64 variant sets: a library built on a CPU with other optional variants, as a
        # Docker image's is, whose ops check the CPU at run time
        others = [(v, directory / f"opentgi_kernels-{cache_key(cxx, v)}.so")
                  for v in X86_VARIANTS if v != isas] if isas in X86_VARIANTS else []
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"compiler {cxx} unusable: {exc}") from None
    target = directory / f"opentgi_kernels-{key}.so"
    if target.is_file():
        return Built(target, isas, time.perf_counter() - start, True)
    for other, other_target in others:
        if set(other) > set(isas) and other_target.is_file():  # every variant this CPU runs
            return Built(other_target, other, time.perf_counter() - start, True)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with _one_builder(directory / f".lock-{key}"):  # a second process waits, then finds the file
            if target.is_file():
                return Built(target, isas, time.perf_counter() - start, True)
            with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
                out = Path(tmp)
                _run_all(_jobs(cxx, out, isas), os.cpu_count() or 1)
                _, link_flags = _torch_flags()
                linked = out / target.name
                _run_all([[cxx, "-shared", *sorted(str(p) for p in out.glob("*.o")), "-o", str(linked),
                           *link_flags]], 1)
                os.rename(linked, target)  # atomic: a reader never sees half a file
    except (BuildError, OSError):
        # not built here (a read-only cache, a compiler without AVX-512): a library without this
        # CPU's best variant serves with the rest rather than none (the one with the most variants)
        for other, other_target in sorted(others, key=lambda found: -len(found[0])):
            if other_target.is_file():
                return Built(other_target, other, time.perf_counter() - start, True)
        raise
    return Built(target, isas, time.perf_counter() - start, False)


@contextlib.contextmanager
def _one_builder(lock: Path):
    """Holds an exclusive lock on `lock` where the platform has one (fcntl), so concurrent starts
    compile once; without it (or on a read-only cache) each builds, and the rename keeps files whole."""
    try:
        import fcntl

        handle = open(lock, "a")  # noqa: SIM115 - held for the block
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        handle.close()


def _run_all(jobs: list[list[str]], parallel: int) -> None:
    """Run the commands, `parallel` at a time, a new one as soon as any finishes; BuildError with
    the first failure's last line. Output goes to a temporary file (a full pipe never stalls one)."""
    pending, running = list(jobs), []
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    try:
        while pending or running:
            while pending and len(running) < parallel:
                command, log = pending.pop(0), tempfile.TemporaryFile(mode="w+")
                running.append((command, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log))
            done = [job for job in running if job[1].poll() is not None]
            if not done:
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(running[0][0], BUILD_TIMEOUT_S)
                time.sleep(0.02)
                continue
            for command, proc, log in done:
                running.remove((command, proc, log))
                log.seek(0)
                output = log.read()
                log.close()
                if proc.returncode != 0:
                    lines = [line for line in output.splitlines() if "error" in line] or output.splitlines() or ["?"]
                    raise BuildError(f"{Path(command[0]).name} failed on {Path(command[-3]).name}: {lines[0][:300]}")
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"compiling failed: {exc}") from None
    finally:
        for _, proc, log in running:
            proc.kill()
            proc.wait()
            log.close()
