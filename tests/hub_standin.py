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
