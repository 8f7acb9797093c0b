"""The web UI at / (llama-server has one there): a chat page over the server's own /v1/chat/completions, its
script, and what makes it an installable app. Static files of this folder, public as llama-server's are (the page
asks for the API key and sends it with its calls); `serve --no-ui` leaves them all out, / included (a 404)."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from ... import __version__

HERE = Path(__file__).parent
# path -> (file, media type)
FILES = {"/": ("index.html", "text/html; charset=utf-8"), "/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/sw.js": ("sw.js", "text/javascript; charset=utf-8"),
         "/manifest.webmanifest": ("manifest.webmanifest", "application/manifest+json"),
         "/icon.svg": ("icon.svg", "image/svg+xml")}
VERSION = "/_app/version.json"  # the UI's version (llama-server's UI reads its own there): kvsession's
PATHS = frozenset(FILES) | {VERSION}
# the page's own script and styles only; never inside another site's frame
HEADERS = {"Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                                      "frame-ancestors 'none'",
           "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}

router = APIRouter()


def _asset(name: str, media_type: str):
    body = (HERE / name).read_bytes()

    async def asset():
        return Response(body, media_type=media_type, headers=HEADERS)
    return asset


for path, (name, media_type) in FILES.items():
    router.add_api_route(path, _asset(name, media_type), methods=["GET", "HEAD"], include_in_schema=False)


@router.api_route(VERSION, methods=["GET", "HEAD"], include_in_schema=False)
async def version():
    return JSONResponse({"version": __version__}, headers=HEADERS)
