"""A Python client of ``carnator serve`` (docs/SERVING.md), and ``carnator generate --server URL``.

    from carnator.client import Client

    c = Client("http://127.0.0.1:8000", key="key-a")          # key: None when the server has no --keys
    job = c.generate("a small red ball moving left on grass", seed=3, out="ball.mp4")
    job["stats"]["tier"], job["stats"]["speedup"]

``generate`` submits with an ``Idempotency-Key`` (retries after a 429/503 or a dropped connection never queue the
job twice), follows the job's events until it finishes and downloads the video. Errors of the server raise
:class:`ServerError` (a :class:`~carnator.errors.CarnatorError`) with its status, type and one-line message.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .errors import CarnatorError

TERMINAL = ("completed", "failed", "cancelled")
#: how long :meth:`Client.generate` keeps trying a server that does not answer before it gives up
CONNECT_WAIT_S = 10.0


class ServerError(CarnatorError):
    """The server refused or failed a call: ``status`` (HTTP), ``type`` and the server's message."""

    def __init__(self, status: int, type: str, message: str, retry_after: float | None = None):
        super().__init__(f"server: {message} (HTTP {status}, {type})")
        self.status, self.type, self.message, self.retry_after = status, type, message, retry_after


class Client:
    """One server, one API key (its tenant). Thread-safe (one ``httpx.Client``)."""

    def __init__(self, url: str, key: str | None = None, *, timeout: float = 30.0, connect_wait: float = CONNECT_WAIT_S):
        try:
            import httpx
        except ImportError:  # pragma: no cover - the serve extra
            raise CarnatorError("carnator.client needs httpx: pip install 'carnator[serve]'") from None
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers,
                                  timeout=httpx.Timeout(timeout, connect=min(timeout, connect_wait)))
        self._httpx = httpx
        self.connect_wait = connect_wait

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- calls -------------------------------------------------------------------------------
    def _call(self, method: str, path: str, **kw):
        try:
            r = self._http.request(method, path, **kw)
        except self._httpx.HTTPError as e:
            raise CarnatorError(f"cannot reach {self.url}: {e}") from None
        if r.status_code >= 400:
            raise _error(r)
        return r

    def submit(self, prompt: str, *, idempotency_key: str | None = None, **params: Any) -> dict[str, Any]:
        """Queue a job (``params``: seed, negative_prompt, num_frames, height, width, num_inference_steps,
        guidance_scale, policy, cache); the job."""
        body = {"prompt": prompt, **{k: v for k, v in params.items() if v is not None}}
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call("POST", "/v1/videos", json=body, headers=headers).json()

    def get(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/videos/{job_id}").json()

    def list(self, *, limit: int = 20, after: str | None = None, order: str = "desc") -> dict[str, Any]:
        params = {"limit": limit, "order": order, **({"after": after} if after else {})}
        return self._call("GET", "/v1/videos", params=params).json()

    def jobs(self) -> Iterator[dict[str, Any]]:
        """Every job of the caller, newest first."""
        after = None
        while True:
            page = self.list(limit=100, after=after)
            yield from page["data"]
            if not page["has_more"]:
                return
            after = page["last_id"]

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/videos/{job_id}").json()

    def content(self, job_id: str, variant: str = "video") -> bytes:
        return self._call("GET", f"/v1/videos/{job_id}/content", params={"variant": variant}).content

    def download(self, job_id: str, path: str | Path) -> Path:
        """Write the video to ``path`` (.gif: the GIF variant; else MP4), atomically."""
        path = Path(path)
        data = self.content(job_id, "gif" if path.suffix.lower() == ".gif" else "video")
        tmp = path.with_name(f".{path.name}.part")
        tmp.write_bytes(data)
        tmp.replace(path)
        return path

    def events(self, job_id: str, *, timeout: float | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        """The job's Server-Sent Events as ``(event, data)`` until ``done`` (or the stream ends)."""
        try:
            with self._http.stream("GET", f"/v1/videos/{job_id}/events", timeout=self._httpx.Timeout(30.0, read=timeout)) as r:
                if r.status_code >= 400:
                    r.read()
                    raise _error(r)
                name = "message"
                data: list[str] = []
                for line in r.iter_lines():
                    if line == "":
                        if data:
                            yield name, json.loads("\n".join(data))
                            if name == "done":
                                return
                        name, data = "message", []
                    elif line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].strip())
        except self._httpx.HTTPError as e:
            raise CarnatorError(f"lost the event stream of {job_id}: {e}") from None

    def wait(self, job_id: str, *, timeout: float = 3600.0, on_event: Callable[[str, dict], None] | None = None) -> dict[str, Any]:
        """Follow the job until it finishes (its events, then a poll if the stream drops); the finished job."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                for name, data in self.events(job_id, timeout=max(1.0, deadline - time.monotonic())):
                    if on_event is not None:
                        on_event(name, data)
                    if name == "done":
                        return data
            except CarnatorError as e:
                if isinstance(e, ServerError) and e.status != 503:
                    raise
                time.sleep(0.5)
            job = self.get(job_id)
            if job["status"] in TERMINAL:
                return job
        raise CarnatorError(f"job {job_id} did not finish within {timeout:.0f} s")

    def generate(self, prompt: str, *, out: str | Path | None = None, timeout: float = 3600.0,
                 on_event: Callable[[str, dict], None] | None = None, **params: Any) -> dict[str, Any]:
        """Submit, wait and (with ``out``) download; the finished job. Waits out 429 and 503 (Retry-After) and
        resubmits with the same Idempotency-Key; a server that cannot be reached is tried for ``connect_wait`` seconds
        (10), then raises :class:`~carnator.errors.CarnatorError`. A job that failed or was cancelled raises
        :class:`ServerError`."""
        key = uuid.uuid4().hex
        deadline = time.monotonic() + timeout
        unreachable_since = None
        while True:
            try:
                job = self.submit(prompt, idempotency_key=key, **params)
                break
            except ServerError as e:
                if e.status not in (429, 503) or time.monotonic() > deadline:
                    raise
                time.sleep(min(e.retry_after or 1.0, max(0.0, deadline - time.monotonic()), 30.0))
            except CarnatorError as e:  # no answer: the same key never queues it twice, but a server that stays
                now = time.monotonic()  # unreachable is said after a short wait, not after the whole timeout
                unreachable_since = now if unreachable_since is None else unreachable_since
                if now > deadline or now - unreachable_since >= self.connect_wait:
                    raise CarnatorError(f"{e} (tried for {self.connect_wait:g} s)") from None
                time.sleep(1.0)
        job = self.wait(job["id"], timeout=max(1.0, deadline - time.monotonic()), on_event=on_event)
        if job["status"] != "completed":
            err = job.get("error") or {"type": job["status"], "message": f"the job was {job['status']}"}
            raise ServerError(200, err["type"], f"job {job['id']} {job['status']}: {err['message']}")
        if out is not None:
            self.download(job["id"], out)
        return job


def _error(r) -> ServerError:
    try:
        err = r.json()["error"]
        kind, msg = str(err["type"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        kind, msg = "http_error", (r.text.strip().splitlines() or [r.reason_phrase])[0][:200]
    ra = r.headers.get("Retry-After")
    try:
        retry = float(ra) if ra is not None else None
    except ValueError:
        retry = None
    return ServerError(r.status_code, kind, msg, retry)


def generate_command(args, out: Path) -> int:
    """``carnator generate --server URL``: the job runs on the server; prints the CLI's one line."""
    local = [("--model", args.model != "embedded"), ("--cache-dir", args.cache_dir), ("--device", args.device),
             ("--capacity", args.capacity_bytes), ("--option", args.policy_options), ("--intra-cache", args.intra_cache),
             ("--no-store", args.no_store), ("--tenant", args.tenant != "default")]
    given = [flag for flag, v in local if v]
    if given:
        raise CarnatorError(f"{', '.join(given)}: with --server these are the server's (the tenant is the API key's)")
    bar = None

    def on_event(name: str, data: dict) -> None:
        nonlocal bar
        if name == "progress":
            if bar is None:
                from tqdm import tqdm

                bar = tqdm(total=data["total"], desc="denoising", unit="step", disable=True if args.quiet else None, leave=False)
            bar.update(data["step"] - bar.n)

    params = {"seed": args.seed, "policy": args.policy, "negative_prompt": args.negative_prompt,
              "num_inference_steps": args.steps, "num_frames": args.frames, "height": args.height, "width": args.width,
              "guidance_scale": args.guidance, "cache": args.cache}
    with Client(args.server, args.api_key) as c:
        try:
            job = c.generate(args.prompt, on_event=on_event, **params)
        except ServerError as e:
            if e.status == 401 and not args.api_key:  # (the server's words name its header, not this command's options)
                raise CarnatorError(f"the server at {args.server} needs an API key: pass --api-key KEY or set "
                                    "CARNATOR_API_KEY") from None
            raise
        finally:
            if bar is not None:
                bar.close()
        tmp = out.with_name(f".{out.name}.server{out.suffix}")
        try:
            c.download(job["id"], tmp)
            if args.fps != 8:  # the server encodes at 8 frames a second: re-encode at --fps
                from .video import read_video, write_video

                write_video(read_video(tmp), out, fps=args.fps)
                tmp.unlink()
            else:
                tmp.replace(out)
        except OSError as e:
            raise CarnatorError(f"cannot write {out}: {e.strerror or e}") from e
    s = job["stats"]
    if args.json:
        print(json.dumps({"out": str(out), "job": job["id"], **s}))
        return 0
    decision = {"exact": "exact hit", "reuse": "hit", "miss": "miss"}[s["tier"]]
    saved = s["steps"] - s["steps_computed"]
    print(f"{decision}: {s['reason']}; {s['seconds']:.2f} s, {s['steps_computed']} of {s['steps']} steps computed"
          f"{f' ({saved} saved)' if saved else ''}; job {job['id']}; wrote {out}")
    return 0
