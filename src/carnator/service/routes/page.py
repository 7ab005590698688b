"""The web page (``GET /``, outside the schema): submit a job, watch its events, play its video."""

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from .deps import Deps


def router(deps: Deps) -> APIRouter:
    cfg = deps.service.config
    page = resources.files("carnator.service").joinpath("page.html").read_text(encoding="utf-8")
    r = APIRouter()

    @r.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index():
        return HTMLResponse(page.replace("{{AUTH}}", "true" if cfg.keys is not None else "false"))

    return r
