"""A stand-in for the Hub's file server in tests (the Hub itself cannot be reached from the tests):
``serving(files, ...)`` makes a request handler for the ``local_hub`` fixture (tests/conftest.py)."""
import http.server


def serving(files: dict, sizes: dict | None = None, refusals: dict | None = None) -> type:
    """A handler that serves ``files`` ({(repository as its address names it, e.g. "org/name" or
    "datasets/org/name", path in the repository): bytes}) of the main revision with the Hub's headers
    (``sizes`` overrides the size the metadata announces); a repository in ``refusals`` gets that
    error code (e.g. "GatedRepo"), a missing file "EntryNotFound". Requests are kept in ``seen``."""

    class FileHub(http.server.BaseHTTPRequestHandler):
        seen: list = []

        def _answer(self, body: bool):
            self.seen.append((self.command, self.path))
            repo, _, rest = self.path.lstrip("/").partition("/resolve/")
            revision, _, name = rest.partition("/")
            data = files.get((repo, name)) if revision == "main" else None
            if data is None:
                code = (refusals or {}).get(repo, "EntryNotFound")
                self.send_response(403 if code == "GatedRepo" else 404)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            for header, value in (("X-Repo-Commit", "e" * 40), ("ETag", f'"{abs(hash(data)):x}"'),
                                  ("X-Linked-Size", str((sizes or {}).get((repo, name), len(data)))),
                                  ("Content-Length", str(len(data)))):
                self.send_header(header, value)
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_HEAD(self):
            self._answer(False)

        def do_GET(self):
            self._answer(True)

        def log_message(self, *args):
            pass

    return FileHub


def committing(repos: dict, refuse: dict | None = None) -> type:
    """A handler for the Hub's repository-creation, pre-upload and commit routes, as ``huggingface_hub``
    calls them: ``repos`` collects {repository: [commits]}, each commit {path: bytes}; every file is
    answered "regular" at pre-upload (sent inside the commit), so no LFS or Xet store is involved. A route
    named in ``refuse`` ("create", "preupload", "commit") gets that HTTP status instead. A README's YAML is
    accepted unread (the tests read cards with ``ModelCard``); ``whoami`` names the token's user "visitor".
    Requests are kept in ``seen``."""
    import base64
    import json

    class CommitHub(http.server.BaseHTTPRequestHandler):
        seen: list = []

        def _reply(self, status: int, data: dict) -> None:
            body = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if status >= 400:
                self.send_header("X-Error-Message", data.get("error", ""))
            self.end_headers()
            self.wfile.write(body)

        def _refused(self, route: str) -> bool:
            if route in (refuse or {}):
                self._reply(refuse[route], {"error": f"refused by the stand-in ({route})"})
                return True
            return False

        def do_GET(self):
            self.seen.append((self.command, self.path))
            if self.path.startswith("/api/whoami-v2"):
                return self._reply(200, {"type": "user", "name": "visitor", "fullname": "A Visitor",
                                         "avatarUrl": "", "auth": {"accessToken": {"role": "write"}}})
            self._reply(404, {"error": "not served by the stand-in"})

        def do_POST(self):
            self.seen.append((self.command, self.path))
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/api/validate-yaml":  # the client asks before committing a README.md
                return self._reply(200, {})
            if self.path == "/api/repos/create":
                if self._refused("create"):
                    return
                asked = json.loads(body)
                repo = f"{asked['organization']}/{asked['name']}"
                repos.setdefault(repo, [])
                return self._reply(200, {"url": f"http://{self.headers['Host']}/{repo}", "name": repo})
            repo, _, route = self.path.removeprefix("/api/models/").partition("/")
            repo = "/".join([repo, route.split("/")[0]])
            route = route.split("/")[1] if "/" in route else ""
            if route == "preupload" and not self._refused("preupload"):
                files = json.loads(body)["files"]
                return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                   for f in files]})
            if route == "commit" and not self._refused("commit"):
                lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                commit = {item["value"]["path"]: base64.b64decode(item["value"]["content"])
                          for item in lines if item["key"] == "file"}
                repos.setdefault(repo, []).append(commit)
                oid = f"{len(repos[repo]):040x}"
                return self._reply(200, {"commitUrl": f"http://{self.headers['Host']}/{repo}/commit/{oid}", "commitOid": oid,
                                         "pullRequestUrl": None})

        def log_message(self, *args):
            pass

    return CommitHub
