"""``carnator serve``: builds the engines, job store, workers and HTTP app, and runs them under uvicorn.

Start-up: take the cache directory's ``serve.lock`` (one server per cache directory: the job table is its own; with
``--store postgresql://...`` the job table is in that database and the lock is a PostgreSQL advisory lock, one server
per database schema), load the model (one engine per device), recover the jobs a killed server left in progress, start the workers, then
listen and print the URL. Ctrl-C (or SIGTERM): the running jobs stop at their next step and go back to the queue
(their attempt not counted), event streams end, the process exits with status 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CarnatorError
from ..request import Params
from .config import ServeConfig, duration_words
from .events import EventHub
from .jobs import VIDEO_DIR, JobStore, JobStoreError, SqliteJobStore
from .metrics import ServiceMetrics
from .worker import Device, MeteredStore, WorkerPool

log = logging.getLogger("carnator.service")

LOCK_FILE = "serve.lock"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def devices_for(device: str) -> list[str]:
    """``cuda``: every visible GPU (one worker each); ``cuda:N`` or ``cpu``: that one."""
    if device == "cuda":
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise CarnatorError("--device cuda: no CUDA device is available here")
        return [f"cuda:{i}" for i in range(n)]
    return [device]


class Service:
    """Everything one server runs: engines (one per device), the job store, workers, event hub and metrics."""

    def __init__(self, config: ServeConfig, *, engines: list[Any] | None = None, store: JobStore | None = None,
                 server_lock: Any = None):
        from .. import __version__
        from ..cache import default_cache_dir
        from ..engine import Carnator, EngineSpec
        from ..policies import policy_names

        self.config = config
        self.version = __version__
        self.cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
        self.metrics = ServiceMetrics()
        self.hub = EventHub()
        self.replicas = None
        store_url = config.store or str(self.cache_dir)
        spec_config = {"allow_uncertified": config.allow_uncertified, **config.engine_config}
        if config.replicas:
            from .scale import RemoteEngine, Replicas, ScaleConfig, gpu_share

            gpu = config.device.startswith("cuda")
            if gpu:
                import torch
            self.replicas = Replicas(
                EngineSpec(model=config.model, device="cuda" if gpu else "cpu", cache_dir=store_url, blobs=config.blobs,
                           config=spec_config),
                ScaleConfig(replicas=config.replicas, ray_address=config.ray_address, router=config.router,
                            num_gpus=gpu_share(config.replicas, torch.cuda.device_count()) if gpu else 0.0,
                            num_cpus=1.0, separate_caches=config.separate_caches,
                            busy_at=config.affinity_busy_at))
            # the ingress validates requests and embeds prompts for the router with an engine on the CPU that has no
            # transformer weights (the replicas build theirs from the same spec on their own devices)
            local = Carnator.from_spec(EngineSpec(model=config.model, device="cpu", cache_dir=store_url,
                                                  blobs=config.blobs, config=spec_config),
                                       dit=False, model_identity=self.replicas.model_identity())
            log.info("the ingress checks and embeds requests without the model's transformer (its replicas run it)")
            names = [f"replica-slot-{i}" for i in range(config.replicas)]
            remote = RemoteEngine(self.replicas, local)
            engines = [remote] * config.replicas
            local.store = MeteredStore(local.store, self.metrics)
            unavailable = remote.store_unavailable
        else:
            names = devices_for(config.device)
            if engines is None:
                engines = [Carnator.from_spec(EngineSpec(model=config.model, device=d, cache_dir=store_url,
                                                         blobs=config.blobs, config=spec_config)) for d in names]
            for eng in engines:
                eng.store = MeteredStore(eng.store, self.metrics)
            unavailable = lambda: sum(int(getattr(e.store, "unavailable", 0)) for e in engines)  # noqa: E731
        self.engine = engines[0]
        if store is None:
            store = open_job_store(config.store, self.cache_dir, server_lock)
        self.store: JobStore = store
        from .audit import AuditConfig, Auditor

        self.auditor = Auditor(self.store, engines, AuditConfig(rate=config.audit, budget=config.audit_budget,
                                                                judge=config.audit_judge, seed=config.audit_seed),
                               self.metrics, self.hub)
        self.metrics.add_audit(self.auditor.report)
        self.pool = WorkerPool(self.store, [Device(n, e) for n, e in zip(names, engines)], self.hub, self.metrics,
                               fps=config.fps, auditor=self.auditor if self.auditor.enabled else None)
        self.policies = tuple(policy_names())
        limit = self.engine.adapter.limits().max_steps
        self.max_steps = min(limit, config.max_steps) if config.max_steps else limit
        per = config.max_queue_per_tenant
        if per is None:
            per = config.max_queue if config.keys is None else max(1, config.max_queue // 2)
        self.max_queue_per_tenant = per
        self.metrics.add_gauges(self.store.counts, self.engine.store.stats, self.pool.running, unavailable)
        self.recovered: dict[str, list[str]] = {}
        self._started = False
        self._stopping = threading.Event()

    def validate(self, params: Params) -> Params:
        """InvalidRequestError (a CarnatorError) when the engine would refuse the request; else ``params`` with its
        unset settings filled in with the model's defaults, so that the job's ``request`` is the request as run."""
        from ..errors import InvalidRequestError

        steps = params.num_inference_steps
        if steps is not None and steps > self.max_steps:
            raise InvalidRequestError(f"num_inference_steps must be at most {self.max_steps} on this server, got {steps}")
        self.engine.policy(params.policy)
        req = self.engine.resolve(params.prompt, seed=params.seed, **params.settings())
        return dataclasses.replace(params, **req.settings())

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        self.recovered = self.store.recover(self.config.max_attempts)
        n = len(self.recovered.get("requeued", []))
        if n:
            self.metrics.requeued.inc(n)
        for kind, ids in self.recovered.items():
            if ids:
                log.warning("%d job(s) left in progress by the previous run: %s", len(ids), kind)
        self.pool.start()
        if self.config.retention_s > 0:
            threading.Thread(target=self._retention_loop, name="carnator-retention", daemon=True).start()

    def expire(self) -> list[str]:
        """Delete the finished jobs (and their videos) older than the retention; their ids."""
        ids = self.store.expire(time.time() - self.config.retention_s)
        if ids:
            log.info("deleted %d finished job(s) and their videos past the retention of %s", len(ids),
                     duration_words(self.config.retention_s))
        return ids

    def _retention_loop(self) -> None:
        every = min(600.0, max(1.0, self.config.retention_s / 10))
        while True:
            try:
                self.expire()
            except JobStoreError as exc:  # the job table busy or unreachable: the next sweep catches up
                log.debug("retention sweep: %s", exc)
            if self._stopping.wait(every):
                return

    def begin_shutdown(self) -> None:
        """At the signal: running jobs stop at their next step (and are requeued), event streams end."""
        self._stopping.set()
        self.pool.drain()
        self.hub.close()

    def stop(self) -> None:
        self.begin_shutdown()
        if not self.pool.stop(timeout=60):
            log.error("a worker did not stop within 60 s")
        with contextlib.suppress(Exception):
            self.store.close()
        if self.replicas is not None:
            self.replicas.shutdown()

    def not_ready(self) -> str | None:
        if self.pool.draining:
            return "the server is shutting down"
        if not self.pool.alive():
            return "no worker is running"
        return self.store.healthy()


def open_job_store(store_url: str | None, cache_dir: Path, server_lock: Any = None) -> JobStore:
    """The job table: in the ``postgresql://`` store's database (videos in ``<cache_dir>/videos``; ``server_lock``:
    what :func:`job_table_lock` yielded, checked before every change), else SQLite in the cache directory."""
    from ..cache.urls import is_shared

    if is_shared(store_url):
        from .pgjobs import PostgresJobStore

        return PostgresJobStore(str(store_url), cache_dir / VIDEO_DIR, server_lock=server_lock)
    return SqliteJobStore(cache_dir)


def job_table_lock(store_url: str | None, cache_dir: Path):
    """One server per job table: the cache directory's lock file (yields None), or for a ``postgresql://`` store a
    PostgreSQL advisory lock (yields the :class:`~carnator.service.pgjobs.ServerLock` for the job store)."""
    from ..cache.urls import is_shared

    if is_shared(store_url):
        from .pgjobs import hold_jobs

        return hold_jobs(str(store_url))
    return serve_lock(cache_dir)


@contextlib.contextmanager
def serve_lock(cache_dir: Path):
    """One ``carnator serve`` per cache directory (its job table); released when the process ends, however."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise CarnatorError(f"another carnator serve (pid {other}) uses the cache directory {cache_dir}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def run(config: ServeConfig, *, out: Callable[[str], None] | None = None) -> int:
    """Serve until Ctrl-C or SIGTERM; 0 after a clean stop."""
    import uvicorn

    from ..cache import default_cache_dir

    say = out or (lambda line: print(line, flush=True))
    if config.keys is None and not is_loopback(config.host):
        raise CarnatorError(f"--host {config.host}: without --keys the server has no authentication and binds to "
                            "loopback only (127.0.0.1 or ::1); pass --keys keys.json to serve other hosts")
    cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    with job_table_lock(config.store, cache_dir) as held:
        service = Service(config, server_lock=held)
        from .app import create_app
        from .http import json_http_protocol

        app = create_app(service)
        server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning", lifespan="on",
                                        timeout_graceful_shutdown=5, access_log=False, http=json_http_protocol()),
                         service, say)
        logging.getLogger("uvicorn.error").addFilter(_NoBindError())
        try:
            server.run()
        except SystemExit:  # uvicorn's way out when it cannot bind (it logged why)
            server.started = False
        if not server.started:
            raise CarnatorError(f"could not listen on {config.host}:{config.port} (in use, or not an address of this host)")
        n = len(service.pool.drained)
        say(f"carnator: stopped{f'; {n} running job(s) requeued for the next start' if n else ''}")
    return 0


class _NoBindError(logging.Filter):
    """uvicorn's own line for a port it cannot bind: ``run`` says it in carnator's one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "while attempting to bind" not in record.getMessage()


class _Server:
    """uvicorn's server, printing the URL once listening and starting the drain at the first signal."""

    def __new__(cls, config: Any, service: Service, say: Callable[[str], None]) -> Any:  # a uvicorn.Server
        import uvicorn

        class Server(uvicorn.Server):
            def __init__(self) -> None:
                super().__init__(config)

            async def startup(self, sockets=None) -> None:
                await super().startup(sockets)
                if self.started and self.servers:
                    host, port = self.servers[0].sockets[0].getsockname()[:2]
                    shown = f"[{host}]" if ":" in host else host
                    auth = "API keys from --keys" if service.config.keys else "no authentication (loopback only)"
                    say(f"carnator: serving {service.config.model} on {', '.join(d.name for d in service.pool.devices)} "
                        f"at http://{shown}:{port}/ ({auth}; Ctrl-C stops)")

            def handle_exit(self, sig, frame) -> None:
                # not in the signal handler itself: it may have interrupted a thread holding a lock begin_shutdown takes
                threading.Thread(target=service.begin_shutdown, name="carnator-drain", daemon=True).start()
                super().handle_exit(sig, frame)

            @contextlib.contextmanager
            def capture_signals(self):
                # uvicorn re-raises the signal after a graceful shutdown; we exit cleanly with status 0 instead
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                original = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for s, h in original.items():
                        signal.signal(s, h)

        return Server()


def serve(config: ServeConfig, *, verbose: bool = False) -> int:
    """``carnator serve`` on a checked ``config`` (the command line's, :mod:`carnator.cli`): the logging a server
    prints, a shared store reached and Ray found before the model loads (one line if not), then :func:`run`."""
    if verbose:
        logging.getLogger("carnator").setLevel(logging.DEBUG)
    else:  # loading bars of diffusers/transformers (the model, the recall embedder) would bury the server's lines
        import diffusers
        import transformers

        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
    if config.store:
        from ..cache import open_store

        open_store(config.store, blobs=config.blobs).close()  # a bad URL or an unreachable store: one line, now
    if config.replicas:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise CarnatorError("--replicas needs Ray Serve: pip install 'carnator[scale]'") from None
    logging.getLogger("carnator.service").setLevel(logging.INFO if not verbose else logging.DEBUG)
    sys.stdout.flush()
    return run(config)
