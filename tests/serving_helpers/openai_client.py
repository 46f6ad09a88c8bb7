"""A minimal client of vLLM's OpenAI-compatible server for the serving tests (standard library only).

Starts ``fullband serve`` in a process group of its own and stops it (:class:`Server`); posts a completion request
and reads the answer whole or as a server-sent-event stream, optionally hanging up after a number of chunks
(:func:`complete`). Every call has a timeout, so a test cannot hang on a dead server.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``command`` (a list) started with ``env``, output in ``log_path``, in its own session (its process group id
    is its PID, so :meth:`stop` reaches vLLM's engine and API processes too)."""

    def __init__(self, command: list[str], port: int, log_path: Path, env: dict, start_timeout: float):
        self.port, self.log_path = port, log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + start_timeout
        while not self.healthy():
            assert self.proc.poll() is None, self.log()[-4000:]
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError("server did not become healthy in time:\n" + self.log()[-4000:])
            time.sleep(1)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException):
            return False

    def post(self, path: str, body: dict, timeout: float = 120) -> dict:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        """SIGTERM to the process group, then SIGKILL after a bounded wait."""
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self._log.close()


def complete(port: int, body: dict, hang_up_after: int | None = None, timeout: float = 180) -> dict:
    """POST /v1/completions. Not streaming: the response's first choice. Streaming (``body["stream"]``): the
    concatenated ``token_ids`` of every chunk and whether the stream ended with ``[DONE]``; with ``hang_up_after``,
    the connection is shut down (both directions) after that many chunks with tokens, mid-answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"status": resp.status, "error": resp.read().decode(errors="replace")[:500]}
        if not body.get("stream"):
            return {"status": 200, **json.loads(resp.read())["choices"][0]}
        tokens: list[int] = []
        chunks, done, finish = 0, False, None
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            choice = json.loads(data)["choices"][0]
            tokens += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
            chunks += bool(choice.get("token_ids"))
            if hang_up_after is not None and chunks >= hang_up_after:
                conn.sock.shutdown(socket.SHUT_RDWR)
                break
        return {"status": 200, "token_ids": tokens, "done": done, "finish_reason": finish}
    finally:
        conn.close()
