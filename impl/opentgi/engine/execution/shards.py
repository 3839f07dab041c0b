"""Starting and watching the ranks of a tensor-parallel group (`--num-shard N`).

Two ways to start a group, one rendezvous: a TCP store held by rank 0 (torch.distributed's
TCPStore; the process group is initialised over it, gloo on CPU, NCCL on CUDA).
- Local (`--num-shard N`): the server process is rank 0 and spawns ranks 1..N-1
  (torch.multiprocessing, spawn), passing them the store's port.
- External (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, as torch's env:// rendezvous reads
  them; e.g. one pod per rank): every process is started by someone else; rank 0 serves HTTP,
  the others only run their shard.

Faults. Every rank bumps a heartbeat counter in the store twice a second from a thread; rank 0
watches the others' counters (and, locally, their processes), and the others watch rank 0's. A
rank that exits or stops beating for HEARTBEAT_TIMEOUT_S makes rank 0 log one clear error, turn
unhealthy, stop its workers and exit non-zero; ranks that lose rank 0 exit at once, so none is
left behind. A start-up error on a rank is stored under `error/<rank>` and reported by rank 0
once. Collectives carry a timeout (COLLECTIVE_TIMEOUT_S), so no rank waits forever in one.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from opentgi.config import Settings

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
HEARTBEAT_TIMEOUT_S = 5.0
COLLECTIVE_TIMEOUT_S = 120.0  # one collective (and the driver's keepalives come every 5 s)
STARTUP_TIMEOUT_S = 600.0  # every rank joining the store and the process group


@dataclass
class Rendezvous:
    master_addr: str
    master_port: int
    rank: int
    world_size: int


def _backend(settings: Settings) -> str:
    from opentgi.models.loader import resolve_device

    return "nccl" if resolve_device(settings).type == "cuda" else "gloo"


def rank_settings(settings: Settings, rank: int, local_rank: int) -> Settings:
    """The settings one rank runs with: its own device (cuda:<local rank>) and, on CPU, its share
    of the cores unless --num-threads says otherwise."""
    from opentgi.models.loader import resolve_device

    mine = copy.copy(settings)
    device = resolve_device(settings)
    if device.type == "cuda":
        mine.device = f"cuda:{local_rank}"
    elif not settings.num_threads:
        mine.num_threads = max(1, (os.cpu_count() or 1) // settings.num_shard)
    return mine


def _connect(store, rdv: Rendezvous, settings: Settings):
    import torch.distributed as dist

    from opentgi.models.loader import resolve_device
    from opentgi.models.parallel import TPGroup

    backend = _backend(settings)
    if backend == "nccl":
        torch.cuda.set_device(resolve_device(settings))
    dist.init_process_group(backend, store=dist.PrefixStore("tp", store), rank=rdv.rank,
                            world_size=rdv.world_size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return TPGroup(rdv.rank, rdv.world_size)


def _store(rdv: Rendezvous, is_master: bool):
    import torch.distributed as dist

    return dist.TCPStore(rdv.master_addr, rdv.master_port, rdv.world_size, is_master=is_master,
                         timeout=timedelta(seconds=STARTUP_TIMEOUT_S), wait_for_workers=False)


class Heartbeat(threading.Thread):
    """Beats for this rank and watches `watched` ranks (and local processes); calls `on_lost` once
    with a message when one of them is gone."""

    def __init__(self, rdv: Rendezvous, watched: list[int], on_lost, processes=None):
        super().__init__(name=f"opentgi-heartbeat-{rdv.rank}", daemon=True)
        self.rdv = rdv
        self.watched = watched
        self.on_lost = on_lost
        self.processes = processes or {}  # rank -> multiprocessing.Process (local launch)
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            store = _store(self.rdv, is_master=False)  # its own connection: stores are not shared
            last = {r: (0, time.monotonic()) for r in self.watched}
            while not self.stopped.wait(HEARTBEAT_S):
                store.add(f"hb/{self.rdv.rank}", 1)
                now = time.monotonic()
                for r, proc in self.processes.items():
                    if proc.exitcode is not None and not self.stopped.is_set():
                        return self.on_lost(r, f"shard {r} exited with code {proc.exitcode}"
                                            + _stored_error(store, r))
                for r in self.watched:
                    count = store.add(f"hb/{r}", 0)
                    if count != last[r][0]:
                        last[r] = (count, now)
                    elif count and now - last[r][1] > HEARTBEAT_TIMEOUT_S and not self.stopped.is_set():
                        return self.on_lost(r, f"shard {r} stopped responding (no heartbeat for "
                                               f"{now - last[r][1]:.0f} s)" + _stored_error(store, r))
        except Exception as exc:  # noqa: BLE001 - the store is gone: so is rank 0
            if not self.stopped.is_set():
                self.on_lost(0, f"lost the rendezvous store ({type(exc).__name__}: {exc})")


def _stored_error(store, rank: int) -> str:
    try:
        if store.check([f"error/{rank}"]):
            return ": " + store.get(f"error/{rank}").decode()
    except Exception:  # noqa: BLE001
        pass
    return ""


# --- ranks > 0 ----------------------------------------------------------------------------------
def run_worker(settings: Settings, rdv: Rendezvous, parent_pid: int | None = None) -> int:
    """The whole life of a rank > 0: join, load its shard, run steps until rank 0 says stop.
    Returns the exit code."""
    import torch.distributed as dist

    from opentgi.engine.execution.assembly import build_runner
    from opentgi.models.loader import load_model

    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)

    def lost(_rank, why):
        log.error("shard %d: %s; exiting", rdv.rank, why)
        os._exit(1)

    store = _store(rdv, is_master=False)
    Heartbeat(rdv, [0], lost).start()
    if parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        tp = _connect(store, rdv, settings)
        runner, *_ = build_runner(load_model(settings, tp=tp), settings)
    except Exception as exc:  # noqa: BLE001 - reported once, by rank 0
        store.set(f"error/{rdv.rank}", f"{type(exc).__name__}: {exc}")
        return 1
    store.set(f"ready/{rdv.rank}", "1")
    try:
        runner.serve_forever()
    except Exception as exc:  # noqa: BLE001 - a collective failed: rank 0 or a peer is gone
        log.error("shard %d: %s: %s; exiting", rdv.rank, type(exc).__name__, exc)
        return 1
    dist.destroy_process_group()
    return 0


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        time.sleep(HEARTBEAT_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _spawned_worker(settings: Settings, rdv: Rendezvous, parent_pid: int) -> None:
    from opentgi.process import keep_gpu_compilers_out_without_cuda, keep_scikit_learn_out

    keep_gpu_compilers_out_without_cuda()  # what the server process does before it loads (process.py)
    keep_scikit_learn_out()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s shard {rdv.rank}: %(message)s")
    code = run_worker(settings, rdv, parent_pid)
    sys.stderr.flush()
    os._exit(code)


# --- rank 0 -------------------------------------------------------------------------------------
class ShardGroup:
    """Rank 0's view of the group: starts it, watches it, stops it."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.world_size = settings.num_shard
        self.external = settings.shard_rank is not None
        self.processes: dict = {}
        self.runner = None
        self.serving = False
        self.failure: str | None = None
        self.on_failure = None  # set by the server: begin shutting down
        self._lock = threading.Lock()
        self._keepalive = threading.Event()

    def start(self, observer=None):
        """Spawn (or meet) the other ranks, load rank 0's shard; returns rank 0's Engine."""
        from opentgi.engine.engine import Engine
        from opentgi.engine.execution import torch_threads
        from opentgi.models.loader import load_model

        s = self.settings
        port = s.master_port if s.master_port is not None else (29500 if self.external else 0)
        rdv = Rendezvous(s.master_addr, port, 0, self.world_size)
        store = _store(rdv, is_master=True)
        rdv.master_port = store.port
        self.rdv = rdv
        if not self.external:
            ctx = torch.multiprocessing.get_context("spawn")
            for r in range(1, self.world_size):
                proc = ctx.Process(target=_spawned_worker, name=f"opentgi-shard-{r}",
                                   args=(rank_settings(s, r, r), Rendezvous(rdv.master_addr, rdv.master_port,
                                                                            r, self.world_size), os.getpid()))
                proc.start()
                self.processes[r] = proc
        self.heartbeat = Heartbeat(rdv, list(range(1, self.world_size)), self._lost, self.processes)
        self.heartbeat.start()
        settings0 = rank_settings(s, 0, s.local_rank)
        try:
            tp = _connect(store, rdv, settings0)
            # loaded in a thread of its own, as Engine.from_settings does (engine/execution/torch_threads.py)
            engine = torch_threads.call_in_own_thread(
                lambda: Engine(load_model(settings0, tp=tp), settings0, observer=observer), settings0.num_threads)
        except Exception:
            self._startup_failed(store)
            raise
        self.runner = engine.runner
        if self.failure:
            self.runner.failure = self.failure
        for r in range(1, self.world_size):
            store.wait([f"ready/{r}"])  # the block-count agreement above already met every rank
        threading.Thread(target=self._keepalive_loop, name="opentgi-keepalive", daemon=True).start()
        self.serving = True
        log.info("%d shards ready (%s)", self.world_size, dist_backend_name())
        return engine

    def _startup_failed(self, store) -> None:
        """Rank 0's start-up raised: stop the others and report once. When another rank failed
        first (rank 0 then only saw the broken collective), its stored error is the one reported."""
        with self._lock:
            reporting = self.failure is not None  # the monitor already said it and is exiting
            self.failure = self.failure or "start-up failed"
        if reporting:
            time.sleep(30)
        self.heartbeat.stopped.set()
        deadline = time.monotonic() + 2.0  # a failing rank stores its error as it goes
        errors: list[str] = []
        while not errors and time.monotonic() < deadline:
            errors = [f"shard {r} failed to start{_stored_error(store, r)}" for r in range(1, self.world_size)
                      if _stored_error(store, r)]
            time.sleep(0.1)
        self._stop_processes()
        if errors:
            raise SystemExit("opentgi: " + "; ".join(errors)) from None

    def _keepalive_loop(self) -> None:
        while not self._keepalive.wait(1.0):
            try:
                self.runner.keepalive()
            except Exception as exc:  # noqa: BLE001 - the monitor reports the cause
                log.debug("keepalive failed: %s", exc)

    def _lost(self, rank: int, why: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = f"tensor-parallel group broken: {why}"
        log.error("%s; shutting down", self.failure)
        if self.runner is not None:
            self.runner.failure = self.failure
        self._stop_processes()
        if not self.serving or self.on_failure is None:
            sys.stderr.flush()
            os._exit(1)
        self.on_failure()
        # the server gets a few seconds to answer what is in flight; then exit regardless
        threading.Timer(10.0, lambda: os._exit(1)).start()

    def _stop_processes(self) -> None:
        for proc in self.processes.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.processes.values():
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def close(self) -> None:
        """After the server stopped: tell the ranks to stop, wait for them, tear down."""
        self._keepalive.set()
        self.heartbeat.stopped.set()
        if self.runner is not None and self.failure is None:
            try:
                self.runner.stop()
            except Exception as exc:  # noqa: BLE001
                log.warning("stopping the shards failed: %s", exc)
        for proc in self.processes.values():
            proc.join(10)
        self._stop_processes()
        import torch.distributed as dist

        if dist.is_initialized() and self.failure is None:
            dist.destroy_process_group()


def dist_backend_name() -> str:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_initialized() else "none"


def check_shardable(settings: Settings) -> None:
    """Before any rank starts: the model exists, the paged code serves it, it splits `num_shard`
    ways, and its LoRA adapters load and fit it (raises SystemExit with the reason, so it is said
    once)."""
    from opentgi.models.loader import ModelLoadError, read_config, resolve_device, resolve_model_folder
    from opentgi.models.parallel import ShardingError, ShardPlan
    from opentgi.models.registry import paged_unsupported_reason

    n = settings.num_shard
    try:
        folder, model_id, _sha = resolve_model_folder(settings)
        config = read_config(folder, settings.trust_remote_code)  # a .gguf file's from its metadata
    except (ModelLoadError, OSError, ValueError) as exc:
        raise SystemExit(f"opentgi: {exc}") from None
    reason = paged_unsupported_reason(config)
    if reason is not None:
        raise SystemExit(f"opentgi: --num-shard {n}: only the paged model code shards, and {model_id!r} "
                         f"is not served by it ({reason})")
    try:
        for rank in range(n):
            ShardPlan.of(config, rank, n)
    except ShardingError as exc:
        raise SystemExit(f"opentgi: --num-shard {n}: {exc}") from None
    if settings.lora_adapters:  # every rank reads them; a bad one is said once, before any starts
        from opentgi.models.checkpoints import text_tower
        from opentgi.models.lora import LoraAdapterError, load_adapters

        try:
            load_adapters(settings.lora_adapters,
                          text_tower.text_config(config) if text_tower.is_text_tower(config) else config, model_id)
        except LoraAdapterError as exc:
            raise SystemExit(f"opentgi: {exc}") from None
    device = resolve_device(settings)
    if settings.shard_rank is None and device.type == "cuda" and torch.cuda.device_count() < n:
        raise SystemExit(f"opentgi: --num-shard {n} needs {n} CUDA devices; "
                         f"{torch.cuda.device_count()} are visible")


def start_group(settings: Settings) -> ShardGroup:
    """Rank 0: checks the model can be split, then a ShardGroup to `start()`."""
    check_shardable(settings)
    return ShardGroup(settings)


def run_external_worker(settings: Settings) -> int:
    """A rank > 0 started externally (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)."""
    port = settings.master_port if settings.master_port is not None else 29500
    rdv = Rendezvous(settings.master_addr, port, settings.shard_rank, settings.num_shard)
    log.info("shard %d of %d: joining %s:%d", rdv.rank, rdv.world_size, rdv.master_addr, port)
    return run_worker(rank_settings(settings, rdv.rank, settings.local_rank), rdv)
