"""A local server that answers like Kaggle's kernels API, for the real `kaggle` CLI (kaggle 2.2.5, kagglesdk).

How the CLI is pointed at it: kagglesdk sends every call as `POST <endpoint>/v1/<service>/<method>` with a JSON body
and basic auth (the username and key of kaggle.json); `KAGGLE_API_ENVIRONMENT=LOCALHOST` (kagglesdk's own switch,
what the kaggle-cli repository's tools/use-localhost.sh sets) makes the endpoint http://localhost/api. There is no
port setting, so the CLI's requests go through `http_proxy` to this server, which answers the absolute-form
request lines a proxy receives: nothing leaves the machine, and no port 80 is taken.

What it answers (the request and response fields of kagglesdk's kernels types, camelCase on the wire):
  kernels.KernelsApiService/SaveKernel               a new version (queued); a new kernel needs a title; a kernel
                                                      source that is no kernel of Kaggle's is listed as invalid
  kernels.KernelsApiService/GetKernelSessionStatus   {status: QUEUED|RUNNING|COMPLETE|ERROR, failureMessage}; 404
  kernels.KernelsApiService/ListKernelSessionOutput  {files: [{fileName, url}], log, nextPageToken}, paged
  GET /blob/<kernel>/<version>/<path>                 an output file (the signed URL the listing hands out)
A wrong key is 401, another user's kernel 403, as Kaggle answers. A session runs when the test says so
(`run_newest`): the saved script, Kaggle-shaped (tests/hosts/kaggle_session.py), with the newest complete output of
each kernel source mounted read-only under input/<slug>; its stdout becomes the log, its working dir the output.
"""
from __future__ import annotations

import base64
import json
import os
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional

SERVICE = "/api/v1/kernels.KernelsApiService/"


class FakeKaggle:
    def __init__(self, tmp: str, user: str = "tester", key: str = "s3cr3t-key") -> None:
        self.tmp, self.user, self.key = tmp, user, key
        self.kernels: Dict[str, List[Dict[str, Any]]] = {}  # "owner/slug" -> versions, oldest first
        self.calls: List[Dict[str, Any]] = []  # every API call: method, body, the user its auth named
        self.lock = threading.Lock()
        self.server: Optional[ThreadingHTTPServer] = None
        self.thread: Optional[threading.Thread] = None

    # --- the test's side -------------------------------------------------------------------------------------
    def start(self) -> "FakeKaggle":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                fake.handle_post(self)

            def do_GET(self) -> None:
                fake.handle_get(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        if self.thread is not None:
            self.thread.join(timeout=5)

    @property
    def url(self) -> str:
        assert self.server is not None
        return "http://127.0.0.1:%d" % self.server.server_address[1]

    def client_env(self, config_dir: str) -> Dict[str, str]:
        """What the kaggle CLI needs to talk to this server with this user's kaggle.json (written here, 0600)."""
        os.makedirs(config_dir, exist_ok=True)
        path = os.path.join(config_dir, "kaggle.json")
        with open(path, "w") as f:
            json.dump({"username": self.user, "key": self.key}, f)
        os.chmod(path, 0o600)
        return {"KAGGLE_API_ENVIRONMENT": "LOCALHOST", "KAGGLE_CONFIG_DIR": config_dir, "http_proxy": self.url,
                "HTTP_PROXY": self.url, "no_proxy": "", "NO_PROXY": "", "https_proxy": "", "HTTPS_PROXY": ""}

    def newest(self, ref: str) -> Dict[str, Any]:
        return self.kernels[ref][-1]

    def run_newest(self, ref: str, runner: Any) -> Dict[str, Any]:
        """Run the newest version's script as Kaggle would: `runner(text, inputs)` returns (exit code, log text,
        working dir); the version is complete (or error) with that log and output."""
        v = self.newest(ref)
        inputs = {}
        for src in v["kernel_sources"]:
            done = [w for w in self.kernels.get(src, []) if w["status"] == "COMPLETE" and w.get("output")]
            if done:
                inputs[src.split("/", 1)[1]] = done[-1]["output"]
        v["status"] = "RUNNING"
        rc, log, working = runner(v["text"], inputs)
        v.update(status="COMPLETE" if rc == 0 else "ERROR", output=working,
                 failure=None if rc == 0 else "the script exited %d" % rc,
                 log=json.dumps([{"stream_name": "stdout", "time": round(i * 0.01, 2), "data": line + "\n"}
                                 for i, line in enumerate(log.splitlines())]))
        return v

    # --- Kaggle's side ---------------------------------------------------------------------------------------
    def _auth_user(self, h: BaseHTTPRequestHandler) -> Optional[str]:
        value = h.headers.get("Authorization") or ""
        if not value.startswith("Basic "):
            return None
        user, _, key = base64.b64decode(value[6:]).decode().partition(":")
        return user if (user, key) == (self.user, self.key) else None

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, code: int, doc: Any) -> None:
        body = json.dumps(doc).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _error(self, h: BaseHTTPRequestHandler, code: int, message: str) -> None:
        self._send(h, code, {"code": code, "message": message})

    def handle_post(self, h: BaseHTTPRequestHandler) -> None:
        path = urllib.parse.urlsplit(h.path).path  # absolute-form when it came as a proxy request
        body = json.loads(h.rfile.read(int(h.headers.get("Content-Length") or 0)) or b"{}")
        user = self._auth_user(h)
        with self.lock:
            self.calls.append({"method": path[len(SERVICE):] if path.startswith(SERVICE) else path, "body": body,
                               "user": user})
        if user is None:
            return self._error(h, 401, "Unauthenticated")
        if not path.startswith(SERVICE):
            return self._error(h, 404, "no such method: %s" % path)
        method = path[len(SERVICE):]
        with self.lock:
            if method == "SaveKernel":
                return self._save(h, user, body)
            ref = "%s/%s" % (body.get("userName"), body.get("kernelSlug"))
            if body.get("userName") != user:
                return self._error(h, 403, "Permission 'kernels.get' was denied")
            if ref not in self.kernels:
                return self._error(h, 404, "Not found")
            v = self.kernels[ref][-1]
            if method == "GetKernelSessionStatus":
                doc: Dict[str, Any] = {"status": v["status"]}
                if v.get("failure"):
                    doc["failureMessage"] = v["failure"]
                return self._send(h, 200, doc)
            if method == "ListKernelSessionOutput":
                return self._list_output(h, ref, v, body)
        return self._error(h, 404, "no such method: %s" % method)

    def _save(self, h: BaseHTTPRequestHandler, user: str, body: Dict[str, Any]) -> None:
        ref = body.get("slug") or ""
        owner = ref.split("/", 1)[0]
        if owner != user:
            return self._error(h, 403, "Permission 'kernels.create' was denied")
        if ref not in self.kernels and not body.get("newTitle"):
            return self._error(h, 400, "A title is required for a new kernel")
        if body.get("language") != "python" or body.get("kernelType") not in ("script", "notebook"):
            return self._error(h, 400, "language and kernelType are required")
        sources = list(body.get("kernelDataSources") or [])
        invalid = [s for s in sources if s not in self.kernels]
        versions = self.kernels.setdefault(ref, [])
        versions.append({"number": len(versions) + 1, "text": body.get("text") or "", "request": body,
                         "kernel_sources": [s for s in sources if s not in invalid], "status": "QUEUED",
                         "log": "", "output": None, "saved_at": time.time()})
        self._send(h, 200, {"ref": "/code/" + ref, "url": "https://www.kaggle.com/code/" + ref,
                            "versionNumber": len(versions), "kernelId": 4242, "invalidKernelSources": invalid,
                            "invalidTags": [], "invalidDatasetSources": [], "invalidCompetitionSources": [],
                            "invalidModelSources": []})

    def _list_output(self, h: BaseHTTPRequestHandler, ref: str, v: Dict[str, Any], body: Dict[str, Any]) -> None:
        files: List[str] = []
        if v.get("output"):
            for d, dirs, names in os.walk(v["output"]):
                dirs.sort()
                files += sorted(os.path.relpath(os.path.join(d, n), v["output"]) for n in names)
        size = min(int(body.get("pageSize") or 20), 200)
        start = int(body.get("pageToken") or 0)
        page = files[start:start + size]
        doc: Dict[str, Any] = {"files": [{"fileName": f, "url": "%s/blob/%s/%d/%s" % (
            "http://localhost", ref, v["number"], urllib.parse.quote(f))} for f in page], "log": v["log"]}
        if start + size < len(files):
            doc["nextPageToken"] = str(start + size)
        self._send(h, 200, doc)

    def handle_get(self, h: BaseHTTPRequestHandler) -> None:
        parts = urllib.parse.urlsplit(h.path).path.split("/", 5)  # "", blob, owner, slug, version, path
        if len(parts) < 6 or parts[1] != "blob":
            return self._error(h, 404, "Not found")
        ref, number, rel = "%s/%s" % (parts[2], parts[3]), int(parts[4]), urllib.parse.unquote(parts[5])
        versions = self.kernels.get(ref) or []
        v = versions[number - 1] if 0 < number <= len(versions) else None
        full = os.path.join(v["output"], rel) if v and v.get("output") else ""
        if not full or ".." in rel.split("/") or not os.path.isfile(full):
            return self._error(h, 404, "Not found")
        with open(full, "rb") as f:
            data = f.read()
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
