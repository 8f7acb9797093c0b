"""The web UI's files (server/webui): every file the page links is one the server serves, and its scripts parse.
What the server answers for them (public, headers, --no-ui) is tested with the guard in test_hostile_http.py."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from kvsession.server import webui


def test_the_page_links_only_what_the_server_serves():
    page = (webui.HERE / "index.html").read_text()
    linked = set(re.findall(r'(?:src|href)="(/[^"]*)"', page))
    assert linked and linked <= webui.PATHS, linked - webui.PATHS
    assert "/app.js" in linked and "<script>" not in page  # no inline script: the policy allows only its own files
    script = (webui.HERE / "app.js").read_text()
    fetched = set(re.findall(r'(?:fetch|register)\("(/[^"]*)"', script))
    assert {"/v1/chat/completions", "/v1/models", "/_app/version.json", "/sw.js"} <= fetched
    assert fetched - {"/v1/chat/completions", "/v1/models"} <= webui.PATHS


@pytest.mark.skipif(shutil.which("node") is None, reason="no Node.js to parse the scripts with")
@pytest.mark.parametrize("name", ["app.js", "sw.js"])
def test_the_scripts_parse(name):
    r = subprocess.run(["node", "--check", str(webui.HERE / name)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
