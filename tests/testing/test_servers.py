"""testing.servers: a server is up once /health answers, and its whole process group is gone after."""

from __future__ import annotations

import os
import sys

import httpx
import pytest

from layerscope.testing.servers import free_port, server

HEALTH = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers(); self.wfile.write(b"ok")
http.server.HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), H).serve_forever()
"""


def test_server_waits_for_health_and_stops_its_group(tmp_path):
    argv = [sys.executable, "-c", HEALTH, "--port", free_port()]
    with server(argv, tmp_path / "s.log", startup_s=60) as (url, proc):
        assert httpx.get(url + "/health", trust_env=False).status_code == 200
        pgid = proc.pid
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_a_server_that_exits_says_so(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('bye'); sys.exit(3)", "--port", free_port()]
    with pytest.raises(RuntimeError, match="exited with 3"):
        with server(argv, tmp_path / "s.log", startup_s=60):
            pass
