"""``carnator serve --replicas N``: the same API, with N engine replicas on Ray Serve behind one ingress.

* The ingress is the ``carnator serve`` process: it owns the job table (durable jobs, idempotency, fair queue,
  cancel, events, metrics: everything of :mod:`carnator.service`) and runs one worker slot per replica. A slot hands
  its job to the Ray Serve deployment through a streaming :class:`~ray.serve.handle.DeploymentHandle` call and relays
  the replica's progress and decision events.
* :class:`EngineReplica` (one per GPU, ``num_gpus=1``, or an equal share of the cards when there are more replicas
  than cards, :func:`gpu_share`; CPU replicas in tests) builds its engine from the serialisable
  :class:`~carnator.engine.EngineSpec` (model, device, store URL, engine and policy config) every other entry point
  uses. With a ``postgresql://`` store all replicas share one cache.
* :class:`AffinityRouter` (Ray Serve's ``RequestRouter`` API) sends a request to the replica that produced its recall
  neighbours when that replica is idle (fewer than ``busy_at`` jobs), else to the least loaded replica; a replica
  takes one job at a time (:data:`MAX_ONGOING`), so concurrent jobs spread over the idle replicas. The neighbours
  come from the ingress's :class:`AffinityIndex`: per tenant, the recall embeddings of the jobs each replica finished
  (the prompt is embedded once at the ingress with the engines' recall embedder). Ray Serve's default power-of-two
  router spreads related prompts across replicas, so each replica's read-through cache (and, with separate caches,
  its whole cache) sees only part of them.
* The live audit (:mod:`carnator.service.audit`) runs at the ingress: it samples the replicas' approximate hits, runs
  each audit's dense request on a replica as the lowest priority job, and disables a tier on the ingress's policy.
  Each job carries that policy's disabled tiers to its replica as plain data (``disabled``, beside the
  :class:`~carnator.request.Params`), and the replica runs the job by its own policy with exactly that set
  (:func:`job_policy`): one bound and one action for the fleet.
* A replica that dies mid-job (killed, out of memory, node lost): the slot retries the job once, as a new attempt of
  the job (its worker records it: ``attempts``, the job's log, ``carnator_jobs_requeued_total``); Ray Serve's router
  has dropped the dead replica, so it runs elsewhere, and the controller starts a replacement. A second death fails
  the job with a reason. Never a hang: every wait is bounded by the job's own progress.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ray import serve
from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from ..errors import Cancelled, GenerationError, InvalidRequestError
from ..request import Params

log = logging.getLogger("carnator.service")

APP_NAME = "carnator"
#: jobs a replica takes at once by default: one. Ray Serve's router refuses a replica that has this many (the replica
#: itself rejects a request past it), so jobs dispatched at the same moment go to different idle replicas instead of
#: queueing on one while another idles (the router's queue lengths are probed, and two probes at once both see 0).
#: ``ScaleConfig.busy_at`` above 1 raises it: a related job may then wait behind that many on its home replica.
MAX_ONGOING = 1


@dataclass
class ScaleConfig:
    """How the replicas are started. ``router``: "affinity" (default) or "pow2" (Ray Serve's default, for
    comparison); ``separate_caches``: each replica its own local cache under the spec's cache directory (a benchmark
    baseline: no sharing)."""

    replicas: int = 2
    ray_address: str | None = None
    router: str = "affinity"
    num_gpus: float = 0.0
    num_cpus: float = 1.0
    separate_caches: bool = False
    min_similarity: float = 0.5
    busy_at: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)


def gpu_share(replicas: int, cards: int) -> float:
    """The GPU each replica asks Ray for: a whole card when there are at least as many cards as replicas, else an
    equal share of them (4 replicas on 1 card: 0.25 each), rounded down so that the shares never add up to more cards
    than there are. The embedded model leaves a card mostly idle with one replica; several share it."""
    if cards < 1:
        raise ValueError("--device cuda with --replicas needs a CUDA device; none is visible")
    if replicas <= cards:
        return 1.0
    return int(cards / replicas * 1e4) / 1e4


# -- routing --------------------------------------------------------------------------------------


class AffinityRouter(FIFOMixin, RequestRouter):
    """Send a request to the first replica named in its ``affinity`` keyword (the replica that produced its recall
    neighbours) when that replica is not overloaded: fewer than ``busy_at`` jobs (``request_router_kwargs``; default
    1: idle), asked of the replica itself. Otherwise (or with no hint) the least loaded replica: Ray Serve probes the
    queue lengths of the last rank and takes the shortest with room."""

    def initialize_state(self, busy_at: int = 1, **kwargs: Any) -> None:
        self.busy_at = int(busy_at)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        import asyncio

        if not candidate_replicas:
            return []
        prefer: list[str] = []
        if pending_request is not None:
            prefer = list(pending_request.kwargs.get("affinity") or [])
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        home = next((by_id[p] for p in prefer if p in by_id), None)
        ranks: list[list[RunningReplica]] = []
        if home is not None:
            try:
                queued = await asyncio.wait_for(home.get_queue_len(deadline_s=1.0), 1.0)
            except Exception:  # noqa: BLE001 - no answer in time: treat it as busy
                queued = None
            if queued is not None and queued < getattr(self, "busy_at", 1):
                ranks.append([home])
        ranks.append(list(candidate_replicas))  # everyone: Serve picks the shortest queue with room
        return ranks


class AffinityIndex:
    """Per tenant, the recall embeddings of finished jobs and the replica that ran each (the newest ``size``)."""

    def __init__(self, min_similarity: float = 0.5, size: int = 4096, k: int = 5):
        self.min_similarity, self.size, self.k = float(min_similarity), int(size), int(k)
        self._rows: dict[str, OrderedDict[int, tuple[np.ndarray, str]]] = {}
        self._n = 0
        self._lock = threading.Lock()

    def add(self, tenant: str, embedding: np.ndarray, replica: str) -> None:
        v = np.asarray(embedding, np.float32).reshape(-1)
        n = float(np.linalg.norm(v))
        if not n:
            return
        with self._lock:
            rows = self._rows.setdefault(tenant, OrderedDict())
            self._n += 1
            rows[self._n] = (v / n, replica)
            while len(rows) > self.size:
                rows.popitem(last=False)

    def preferred(self, tenant: str, embedding: np.ndarray) -> list[str]:
        """Replicas that ran the nearest earlier jobs (cosine >= ``min_similarity``), by summed similarity."""
        with self._lock:
            rows = list(self._rows.get(tenant, {}).values())
        if not rows:
            return []
        q = np.asarray(embedding, np.float32).reshape(-1)
        q = q / (np.linalg.norm(q) or 1.0)
        mat = np.stack([r[0] for r in rows])
        if mat.shape[1] != q.shape[0]:
            return []
        sims = mat @ q
        top = np.argsort(-sims, kind="stable")[: self.k]
        score: dict[str, float] = {}
        for i in top:
            if sims[i] >= self.min_similarity:
                score[rows[i][1]] = score.get(rows[i][1], 0.0) + float(sims[i])
        return sorted(score, key=lambda r: -score[r])


# -- cancelling across processes ---------------------------------------------------------------------

BOARD_NAME = "carnator-cancel-board"
#: how often a running job asks the board whether it was cancelled (seconds)
CANCEL_POLL_S = 0.5


class CancelBoard:
    """A tiny Ray actor holding the tokens of cancelled jobs: the ingress writes, replicas read (Ray Serve does not
    stop a streaming call's generator when the caller cancels it, and a cancel cannot be routed to one replica)."""

    def __init__(self) -> None:
        self._tokens: OrderedDict[str, None] = OrderedDict()

    def cancel(self, token: str) -> None:
        self._tokens[token] = None
        while len(self._tokens) > 10000:
            self._tokens.popitem(last=False)

    def is_cancelled(self, token: str) -> bool:
        return token in self._tokens


def _board():
    import ray

    return ray.get_actor(BOARD_NAME, namespace="carnator")


# -- the replica ----------------------------------------------------------------------------------


def job_policy(engine: Any, params: Params, disabled: Any) -> Any:
    """The policy instance a replica runs ``params`` by, given the ``(kind, step)`` tiers its job carries: None (the
    engine's own policy of that name) when it carries none (None) or the policy has no tiers to disable, or when the
    set is the one that policy already has; else a copy of it with exactly ``disabled`` off, for this job only (the
    engine's own is never changed, so jobs running at once on one replica never see each other's set)."""
    if disabled is None:
        return None
    pol = engine.policy(params.policy)
    if not hasattr(pol, "with_disabled"):
        return None
    tiers = frozenset((str(k), int(s)) for k, s in disabled)
    return None if tiers == getattr(pol, "disabled_tiers", None) else pol.with_disabled(tiers)



@serve.deployment(max_ongoing_requests=MAX_ONGOING, health_check_period_s=2, health_check_timeout_s=30,
                  graceful_shutdown_timeout_s=5)
class EngineReplica:
    """One engine built from an :class:`~carnator.engine.EngineSpec`; streams each job's events and its result."""

    def __init__(self, spec: dict[str, Any], separate_caches: bool = False, threads: int | None = None) -> None:
        import torch

        from ..engine import Carnator, EngineSpec

        if threads:
            torch.set_num_threads(threads)
        self.replica = serve.get_replica_context().replica_id.unique_id
        s = EngineSpec.from_dict(spec)
        if separate_caches:
            import dataclasses

            base = s.cache_dir or os.path.expanduser("~/.cache/carnator")
            s = dataclasses.replace(s, cache_dir=os.path.join(base, f"replica-{self.replica}"))
        self.engine = Carnator.from_spec(s)
        self._engine_lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        return {"replica": self.replica, "pid": os.getpid(), "model_identity": self.engine.model_identity}

    def store_counters(self) -> dict[str, int]:
        """This replica's totals: bytes read from shared blob storage, calls served degraded (PostgreSQL down)."""
        st = self.engine.store
        return {"blob_bytes_read": int(getattr(st, "bytes_read", 0)), "store_unavailable": int(getattr(st, "unavailable", 0))}

    def generate(self, params: Params, affinity: list[str] | None = None, token: str | None = None,
                 disabled: list[tuple[str, int]] | None = None):
        """Run one job, streaming its events and then its result. ``disabled``: the ``(kind, step)`` tiers the
        ingress's live audit disabled when it sent the job (None: this replica's policy as it is)."""
        import ray

        events: queue.Queue = queue.Queue()
        stop = threading.Event()
        last = [time.monotonic()]

        def cancelled() -> bool:  # at every step: the stream closed, or the ingress cancelled the job
            if stop.is_set():
                return True
            if token is None or time.monotonic() - last[0] < CANCEL_POLL_S:
                return False
            last[0] = time.monotonic()
            try:
                if ray.get(_board().is_cancelled.remote(token), timeout=5):
                    stop.set()
            except Exception as exc:  # noqa: BLE001 - the board unreachable: carry on
                log.debug("cancel board: %s", exc)
            return stop.is_set()

        yield {"kind": "started", "replica": self.replica, "pid": os.getpid()}

        def run() -> None:
            try:
                res = self.engine.run(
                    params,
                    progress=lambda d, t: events.put({"kind": "progress", "done": d, "total": t}),
                    cancel=cancelled,
                    events=lambda k, d: events.put({"kind": "event", "name": k, "data": _plain(d)}),
                    policy=job_policy(self.engine, params, disabled),
                )
                emb = None
                try:
                    emb = self.engine.embed(res.request.prompt)  # the same embedding the ingress computes
                except Exception:  # noqa: BLE001 - affinity is best effort
                    pass
                if self.engine.write_behind:  # the job's stats name the entry it stored
                    try:
                        self.engine.flush(res)
                    except Exception:  # noqa: BLE001 - the video is made; a failed store costs only the entry
                        log.exception("storing a cache entry failed on replica %s", self.replica)
                events.put({"kind": "result", "frames": res.frames, "stats": res.stats, "request": res.request,
                            "embedding": emb, "counters": self.store_counters()})
            except Cancelled:
                events.put({"kind": "cancelled"})
            except InvalidRequestError as e:
                events.put({"kind": "error", "type": "invalid_request", "message": str(e)})
            except Exception as e:
                log.exception("job failed on replica %s", self.replica)
                events.put({"kind": "error", "type": "generation_error", "message": str(e).strip().splitlines()[0]
                            if str(e).strip() else type(e).__name__})

        th = threading.Thread(target=run, daemon=True, name="carnator-replica-job")
        th.start()
        try:
            while True:
                item = events.get()
                yield item
                if item["kind"] in ("result", "error", "cancelled"):
                    return
        finally:  # the ingress cancelled the stream (or went away): stop the job at its next step
            stop.set()


def _plain(data: Any) -> Any:
    try:
        import json

        json.dumps(data)
        return data
    except TypeError:
        return {k: v for k, v in data.items() if isinstance(v, (str, int, float, bool, type(None)))} if isinstance(data, dict) else str(data)


# -- the ingress side -------------------------------------------------------------------------------


class Replicas:
    """The Ray Serve application of N engine replicas, as the ingress sees it."""

    def __init__(self, spec: Any, config: ScaleConfig) -> None:
        import ray
        from ray.serve.config import RequestRouterConfig

        self.config = config
        env = {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "HF_HUB_OFFLINE", "CARNATOR_CACHE_DIR")}
        env.update(config.extra_env)
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"namespace": "carnator", "log_to_driver": False, "include_dashboard": False,
                                      "runtime_env": {"env_vars": env}}
            if config.ray_address:
                kwargs["address"] = config.ray_address
            else:
                kwargs["num_cpus"] = max(os.cpu_count() or 1, int(np.ceil(config.replicas * config.num_cpus)) + 1)
                if config.num_gpus:
                    import torch

                    kwargs["num_gpus"] = torch.cuda.device_count()
            ray.init(**kwargs)
            self._owns_ray = True
            if not config.ray_address:  # the local cluster ends with this server, even one killed with -9
                from .reaper import start

                self._reaper = start()
        else:
            self._owns_ray = False
        serve.start(proxy_location="Disabled")
        options: dict[str, Any] = {
            "num_replicas": config.replicas,
            "max_ongoing_requests": max(MAX_ONGOING, int(config.busy_at)),
            "ray_actor_options": {"num_cpus": config.num_cpus, "num_gpus": config.num_gpus},
        }
        if config.router == "affinity":
            options["request_router_config"] = RequestRouterConfig(request_router_class=AffinityRouter,
                                                                   request_router_kwargs={"busy_at": config.busy_at})
        elif config.router != "pow2":
            raise ValueError(f"router must be affinity or pow2, got {config.router!r}")
        threads = None if config.num_gpus else max(1, int((os.cpu_count() or 1) // max(1, config.replicas)))
        app = EngineReplica.options(**options).bind(spec.to_dict(), config.separate_caches, threads)  # type: ignore[attr-defined]
        self.board = ray.remote(num_cpus=0)(CancelBoard).options(name=BOARD_NAME, namespace="carnator",
                                                                  get_if_exists=True).remote()
        self.handle = serve.run(app, name=APP_NAME, route_prefix=None)
        self.affinity = AffinityIndex(config.min_similarity) if config.router == "affinity" else None

    def model_identity(self) -> str:
        """The model's identity as a replica (which has its weights) computes it."""
        return str(self.handle.info.remote().result(timeout_s=120)["model_identity"])

    def shutdown(self) -> None:
        import ray

        try:
            serve.delete(APP_NAME)
            serve.shutdown()
        except Exception as exc:  # noqa: BLE001 - shutting down anyway
            log.debug("serve shutdown: %s", exc)
        if self._owns_ray:
            ray.shutdown()


class RemoteEngine:
    """What a worker slot calls instead of a local engine: ``generate`` runs the job on a replica (chosen by the
    router, with the affinity hint), relays progress and decision events, retries once if the replica dies, and
    returns a :class:`~carnator.request.Result` like the engine's."""

    def __init__(self, replicas: Replicas, local: Any) -> None:
        self.replicas, self.local = replicas, local
        self.adapter = local.adapter
        self.counters: dict[str, dict[str, int]] = {}  # per replica, its latest running totals

    def store_unavailable(self) -> int:
        """Cache calls the replicas served without their store (PostgreSQL unreachable), as last reported."""
        return sum(c.get("store_unavailable", 0) for c in list(self.counters.values()))

    def __getattr__(self, name: str) -> Any:  # policy(), resolve(), store, ... of the ingress's engine
        return getattr(self.local, name)

    def disabled_tiers(self, policy: str) -> list[tuple[str, int]] | None:
        """The ``(kind, step)`` tiers the ingress's policy ``policy`` has disabled (the live audit disables them there),
        sorted: what a job carries to its replica. None for a policy without tiers to disable."""
        try:
            pol = self.local.policy(policy)
        except Exception:  # noqa: BLE001 - an unknown policy: the replica says so
            return None
        tiers = getattr(pol, "disabled_tiers", None)
        return None if tiers is None else sorted(tiers)

    def generate(self, prompt: str, *, progress: Any = None, cancel: Any = None, events: Any = None, **params: Any) -> Any:
        """:meth:`run` of ``Params(prompt, **params)`` (``Carnator.generate``'s keywords)."""
        return self.run(Params(prompt=prompt, **{"cache": "reuse", **params}), progress=progress, cancel=cancel, events=events)

    def run(self, params: Params, *, progress: Any = None, cancel: Any = None, events: Any = None) -> Any:
        from ray.exceptions import RayError

        from ..request import Result

        prompt, tenant = params.prompt, params.tenant
        aff = self.replicas.affinity
        affinity: list[str] = []
        emb = None
        if aff is not None:
            try:
                emb = self.local.embed(prompt)
                affinity = aff.preferred(tenant, emb)
            except Exception as exc:  # noqa: BLE001 - routing without a hint is still routing
                log.debug("no affinity hint: %s", exc)
        last: BaseException | None = None
        for attempt in (1, 2):
            token = uuid.uuid4().hex
            # read at each dispatch: a tier disabled since the first attempt is off for the retry too
            disabled = self.disabled_tiers(params.policy)
            gen = self.replicas.handle.options(stream=True).generate.remote(params, affinity=affinity, token=token,
                                                                             disabled=disabled)
            replica = "?"
            try:
                for item in gen:
                    kind = item["kind"]
                    if kind == "started":
                        replica = item["replica"]
                        log.info("replica %s (pid %d) runs a job (attempt %d)", replica, item["pid"], attempt)
                    elif kind == "progress" and progress is not None:
                        progress(item["done"], item["total"])
                    elif kind == "event" and events is not None:
                        events(item["name"], item["data"])
                    elif kind == "result":
                        st = item["stats"]
                        st.notes["replica"] = replica
                        st.notes["replica_attempt"] = attempt
                        st.notes.update(item.get("counters") or {})  # this replica's running totals
                        self.counters[replica] = dict(item.get("counters") or {})
                        if aff is not None and (emb is not None or item.get("embedding") is not None):
                            aff.add(tenant, emb if emb is not None else item["embedding"], replica)
                        return Result(frames=item["frames"], stats=st, request=item["request"])
                    elif kind == "cancelled":
                        raise Cancelled()
                    elif kind == "error":
                        if item["type"] == "invalid_request":
                            raise InvalidRequestError(item["message"])
                        raise GenerationError(item["message"])
                    if cancel is not None and cancel():
                        self.replicas.board.cancel.remote(token)  # the replica stops at its next step
                        gen.cancel()
                        raise Cancelled()
                raise RayError("the replica's stream ended without a result")
            except RayError as exc:
                last = exc
                log.warning("replica %s failed mid-job (%s); %s", replica, type(exc).__name__,
                            "retrying once on another replica" if attempt == 1 else "giving up")
                affinity = [a for a in affinity if a != replica]
                if attempt == 1 and events is not None:  # the worker records a new attempt of the job
                    events("retry", {"replica": replica,
                                     "reason": f"replica {replica} failed mid-job ({type(exc).__name__})"})
        raise GenerationError(f"the job's replica failed twice ({type(last).__name__}); try again")
