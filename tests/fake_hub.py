"""A fake Hugging Face Hub on 127.0.0.1 for offline tests of uploads.

It answers exactly the calls huggingface_hub (2.x) makes for `HfApi.create_repo` +
`HfApi.upload_folder` on the non-Xet path, and records everything that arrives:

| call | endpoint |
|---|---|
| `create_repo` | `POST /api/repos/create` (409 when the repo exists, as the Hub does) |
| `create_branch` | `POST /api/models/{repo}/branch/{branch}` |
| README.md check | `POST /api/validate-yaml` (YAML header must parse to a mapping) |
| upload modes | `POST /api/models/{repo}/preupload/{revision}`: `"lfs"` for paths matching `lfs_patterns`, else `"regular"` |
| LFS (only for `"lfs"` files) | `POST /{repo}.git/info/lfs/objects/batch`, then `PUT /__lfs__/{oid}` and `POST /__lfs_verify__/{oid}` |
| commit | `POST /api/models/{repo}/commit/{revision}`, an ndjson body: `header`, `file` (base64), `lfsFile`, `deletedFile`/`deletedFolder` |
| `whoami`, `repo_info` | `GET /api/whoami-v2`, `GET /api/models/{repo}[/revision/{rev}]` |

Any other request gets a 404 and lands in `FakeHub.unexpected`, so a test notices a new call
(for instance the Xet path, which a test must switch off with
`huggingface_hub.constants.HF_HUB_DISABLE_XET = True`; `is_xet_available()` reads it at call time).
Write calls without `Authorization: Bearer ...` get a 401, as on the Hub.

Example:
    ```python
    with FakeHub(lfs_patterns=("*.safetensors",)) as hub:
        HfApi(endpoint=hub.endpoint, token="hf_x").create_repo("me/m")
        ...
        hub.files("me/m")  # {path: bytes} on main
    ```
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

_REPO = r"(?P<repo>[^/]+/[^/]+|[^/]+)"
_YAML_BLOCK = re.compile(r"^(\s*---(?:\r\n|\r|\n))([\S\s]*?)((?:\r\n|\r|\n)---[ \t]*(\r\n|\n|$))")


@dataclass
class Request:
    """One request as it arrived (headers with lower-case names)."""

    method: str
    path: str
    query: dict
    headers: dict
    body: bytes

    def json(self):
        return json.loads(self.body or b"null")


@dataclass
class Repo:
    repo_id: str
    private: bool | None = None
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    commits: list[dict] = field(default_factory=list)
    heads: dict[str, str] = field(default_factory=lambda: {"main": "0" * 40})
    prs: int = 0


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, **extra):
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra


class FakeHub:
    """A threaded HTTP server that mimics the Hub's upload API; start with `with FakeHub() as hub:`.

    Args:
        lfs_patterns: Glob patterns of paths answered with upload mode `"lfs"` (sent through the LFS
            batch API); every other file is `"regular"` and travels base64-inlined in the commit.
        user: Namespace of repos created without one, and the `whoami` name.
        require_auth: Answer 401 to write calls without a bearer token.
    """

    def __init__(self, *, lfs_patterns=(), user: str = "fake-user", require_auth: bool = True):
        self.lfs_patterns = tuple(lfs_patterns)
        self.user = user
        self.require_auth = require_auth
        self.requests: list[Request] = []
        self.unexpected: list[Request] = []
        self.repos: dict[str, Repo] = {}
        self.lfs_store: dict[str, bytes] = {}
        self.validated_yaml: list[str] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life cycle

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("FakeHub is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FakeHub":
        hub = self

        class Handler(_Handler):
            fake = hub

        # Port 0: the OS picks a free port, so parallel test runs never collide.
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        # A short poll interval: shutdown() waits for it, once per test.
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None

    def __enter__(self) -> "FakeHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ what tests read

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """`{path: bytes}` of a branch (or `refs/pr/N`) after the commits so far."""
        return dict(self.repos[repo_id].branches[revision])

    def commits(self, repo_id: str) -> list[dict]:
        return list(self.repos[repo_id].commits)

    def tokens(self) -> set[str]:
        """Bearer tokens seen in any request."""
        out = set()
        for r in self.requests:
            auth = r.headers.get("authorization", "")
            if auth.lower().startswith("bearer "):
                out.add(auth[7:])
        return out

    # ------------------------------------------------------------------ routing

    def handle(self, req: Request) -> tuple[int, dict, dict]:
        """Return (status, json body, extra headers); raises HubError for Hub-style errors."""
        routes = [
            ("POST", r"/api/repos/create", self._create_repo),
            ("POST", r"/api/validate-yaml", self._validate_yaml),
            ("GET", r"/api/whoami-v2", self._whoami),
            ("POST", rf"/api/models/{_REPO}/preupload/(?P<rev>[^/]+)", self._preupload),
            ("POST", rf"/api/models/{_REPO}/commit/(?P<rev>[^/]+)", self._commit),
            ("POST", rf"/api/models/{_REPO}/branch/(?P<branch>[^/]+)", self._create_branch),
            ("POST", rf"/{_REPO}\.git/info/lfs/objects/batch", self._lfs_batch),
            ("PUT", r"/__lfs__/(?P<oid>[0-9a-f]{64})", self._lfs_put),
            ("POST", r"/__lfs_verify__/(?P<oid>[0-9a-f]{64})", self._lfs_verify),
            ("GET", rf"/api/models/{_REPO}/revision/(?P<rev>[^/]+)", self._repo_info),
            ("GET", rf"/api/models/{_REPO}", self._repo_info),
        ]
        for method, pattern, fn in routes:
            match = re.fullmatch(pattern, req.path)
            if method == req.method and match:
                return fn(req, **{k: unquote(v) for k, v in match.groupdict().items()})
        with self._lock:
            self.unexpected.append(req)
        raise HubError(404, f"fake hub: no route for {req.method} {req.path}", "EntryNotFound")

    def _auth(self, req: Request) -> None:
        if self.require_auth and not req.headers.get("authorization", "").lower().startswith("bearer "):
            raise HubError(401, "Invalid username or password.", None)

    def _repo(self, repo_id: str) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None:
            raise HubError(404, f"Repository Not Found for url: {repo_id}", "RepoNotFound")
        return repo

    # ------------------------------------------------------------------ endpoints

    def _create_repo(self, req):
        self._auth(req)
        body = req.json()
        repo_id = f"{body.get('organization') or self.user}/{body['name']}"
        if body.get("type") not in (None, "model"):
            raise HubError(400, f"fake hub handles model repos only, got {body.get('type')!r}")
        with self._lock:
            if repo_id in self.repos:
                # The Hub's 409 carries the repo URL; create_repo(exist_ok=True) reads it.
                raise HubError(409, "You already created this model repo", None, url=f"{self.endpoint}/{repo_id}")
            self.repos[repo_id] = Repo(repo_id, private=body.get("visibility") == "private" if "visibility" in body else body.get("private"))
        return 200, {"url": f"{self.endpoint}/{repo_id}", "name": repo_id, "id": repo_id}, {}

    def _create_branch(self, req, repo, branch):
        self._auth(req)
        r = self._repo(repo)
        with self._lock:
            if branch in r.branches:
                raise HubError(409, f"Reference already exists: {branch}", None)
            start = (req.json() or {}).get("startingPoint") or "main"
            r.branches[branch] = dict(r.branches[start])
            r.heads[branch] = r.heads[start]
        return 200, {}, {}

    def _validate_yaml(self, req):
        content = req.json().get("content", "")
        self.validated_yaml.append(content)
        match = _YAML_BLOCK.search(content)
        if match:
            try:
                data = yaml.safe_load(match.group(2))
            except yaml.YAMLError as err:
                return 400, {"errors": [{"message": f"YAML: {err}"}], "warnings": []}, {}
            if data is not None and not isinstance(data, dict):
                return 400, {"errors": [{"message": "metadata must be a mapping"}], "warnings": []}, {}
        return 200, {"errors": [], "warnings": []}, {}

    def _whoami(self, req):
        self._auth(req)
        return 200, {"type": "user", "name": self.user, "auth": {"type": "access_token"}}, {}

    def _repo_info(self, req, repo, rev="main"):
        r = self._repo(repo)
        if rev not in r.heads:
            raise HubError(404, f"Revision Not Found: {rev}", "RevisionNotFound")
        siblings = [{"rfilename": p} for p in sorted(r.branches[rev])]
        return 200, {"id": repo, "modelId": repo, "sha": r.heads[rev], "private": bool(r.private), "siblings": siblings}, {}

    def _mode(self, path: str) -> str:
        return "lfs" if any(fnmatch.fnmatch(path, pattern) for pattern in self.lfs_patterns) else "regular"

    def _preupload(self, req, repo, rev):
        self._auth(req)
        self._repo(repo)
        files = [
            {"path": f["path"], "uploadMode": self._mode(f["path"]), "shouldIgnore": False, "oid": None}
            for f in req.json()["files"]
        ]
        return 200, {"files": files, "commitOid": None}, {}

    def _lfs_batch(self, req, repo):
        self._auth(req)
        self._repo(repo)
        body = req.json()
        objects = []
        for obj in body["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.lfs_store:  # the Hub leaves out actions for blobs it already has
                entry["actions"] = {
                    "upload": {"href": f"{self.endpoint}/__lfs__/{obj['oid']}"},
                    "verify": {"href": f"{self.endpoint}/__lfs_verify__/{obj['oid']}"},
                }
            objects.append(entry)
        return 200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}, {}

    def _lfs_put(self, req, oid):
        if hashlib.sha256(req.body).hexdigest() != oid:
            raise HubError(400, "sha256 of the uploaded bytes does not match the oid")
        with self._lock:
            self.lfs_store[oid] = req.body
        return 200, {}, {}

    def _lfs_verify(self, req, oid):
        body = req.json()
        if oid not in self.lfs_store or len(self.lfs_store[oid]) != body.get("size"):
            raise HubError(404, f"LFS object {oid} not found or of the wrong size")
        return 200, {}, {}

    def _commit(self, req, repo, rev):
        self._auth(req)
        r = self._repo(repo)
        if req.headers.get("content-type") != "application/x-ndjson":
            raise HubError(400, f"commit must be ndjson, got {req.headers.get('content-type')!r}")
        lines = [json.loads(line) for line in req.body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "commit payload must start with a header line")
        header = lines[0]["value"]
        create_pr = req.query.get("create_pr") == ["1"]
        with self._lock:
            if create_pr:
                r.prs += 1
                branch = f"refs/pr/{r.prs}"
                r.branches[branch] = dict(r.branches[rev])
                r.heads[branch] = r.heads[rev]
            else:
                branch = rev
            if branch not in r.branches:
                raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            tree = dict(r.branches[branch])
            changed = []
            for line in lines[1:]:
                key, value = line["key"], line["value"]
                if key == "file":
                    if value.get("encoding") != "base64":
                        raise HubError(400, f"unsupported encoding {value.get('encoding')!r}")
                    tree[value["path"]] = base64.b64decode(value["content"])
                elif key == "lfsFile":
                    if value["oid"] not in self.lfs_store:
                        raise HubError(400, f"LFS object {value['oid']} of {value['path']} was never uploaded")
                    tree[value["path"]] = self.lfs_store[value["oid"]]
                elif key == "deletedFile":
                    tree.pop(value["path"], None)
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    tree = {p: b for p, b in tree.items() if not p.startswith(prefix)}
                else:
                    raise HubError(400, f"unknown commit operation {key!r}")
                changed.append((key, value["path"]))
            oid = hashlib.sha1(json.dumps([r.heads[branch], header, changed]).encode()).hexdigest()
            r.branches[branch] = tree
            r.heads[branch] = oid
            r.commits.append({"oid": oid, "branch": branch, "summary": header.get("summary"), "operations": changed})
        out = {"success": True, "commitOid": oid, "commitUrl": f"{self.endpoint}/{repo}/commit/{oid}"}
        if create_pr:
            out["pullRequestUrl"] = f"{self.endpoint}/{repo}/discussions/{r.prs}"
        return 200, out, {}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the Hub; every response carries a Content-Length
    fake: FakeHub

    def log_message(self, *args):  # quiet test output
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _serve(self):
        url = urlsplit(self.path)
        req = Request(
            method=self.command,
            path=url.path,
            query=parse_qs(url.query),
            headers={k.lower(): v for k, v in self.headers.items()},
            body=self._body(),
        )
        with self.fake._lock:
            self.fake.requests.append(req)
        headers = {}
        try:
            status, payload, headers = self.fake.handle(req)
        except HubError as err:
            status, payload = err.status, {"error": err.message, **err.extra}
            if err.code:
                headers["X-Error-Code"] = err.code
        except Exception as err:  # noqa: BLE001 - a bug in the fake reaches the test as a 400 (a 500 would be retried)
            status, payload = 400, {"error": f"fake hub crashed: {type(err).__name__}: {err}"}
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _serve


def use_fake_hub_env(monkeypatch, token: str) -> None:
    """Point huggingface_hub at a fake Hub for one test: Xet off, offline mode off, `token` as the token.

    The Xet path would talk to a CAS server the fake does not serve (`is_xet_available` reads the
    constant at call time); `make test` exports HF_HUB_OFFLINE=1, and these tests talk only to 127.0.0.1.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import _runtime

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    assert not _runtime.is_xet_available()
