"""The Hugging Face Hub's HTTP API as `huggingface_hub` meets it when it creates a repository, a branch and uploads
a folder, served on 127.0.0.1 (HF_ENDPOINT): repository creation, the pre-upload check (small files inline, large
ones as LFS), the LFS batch API and its uploads, and the commit (NDJSON). Repositories live in memory; a
namespace other than the token's is refused with 403, as the Hub refuses it.

It proves the client side: what `toolkit push` sends, in which calls, and what arrives. It does not prove the
Hub's own processing (its validation of the card's metadata, LFS storage, Xet, rate limits)."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "hf_stand_in_token"
LARGE = 1024  # bytes from which a file goes as LFS (the Hub's threshold is larger; small here to exercise both)


class HubStandIn:
    def __init__(self, user: str = "me"):
        self.user = user
        self.repos: dict[str, dict] = {}  # repo id -> {"private": bool, "branches": {name: {path: bytes}}}
        self.lfs: dict[str, bytes] = {}  # oid -> content
        self.calls: list[tuple[str, str]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def reply(self, status: int, payload=None) -> None:
                data = json.dumps(payload if payload is not None else {}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status >= 400:
                    self.send_header("X-Error-Message", payload.get("error", "") if payload else "")
                self.end_headers()
                self.wfile.write(data)

            def authorized(self) -> bool:
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self.reply(401, {"error": "Invalid credentials in Authorization header"})
                    return False
                return True

            def do_GET(self):
                stand_in.calls.append(("GET", self.path))
                if self.path.startswith("/api/whoami"):
                    if self.authorized():
                        self.reply(200, {"name": stand_in.user, "type": "user", "orgs": []})
                    return
                self.reply(404, {"error": "not here"})

            def do_PUT(self):  # an LFS upload to the href the batch answer gave
                stand_in.calls.append(("PUT", self.path))
                data = self.body()
                oid = self.path.rsplit("/", 1)[-1]
                if hashlib.sha256(data).hexdigest() != oid:
                    self.reply(400, {"error": "content does not match its oid"})
                    return
                stand_in.lfs[oid] = data
                self.reply(200, {})

            def do_POST(self):
                stand_in.calls.append(("POST", self.path))
                path, data = self.path.split("?")[0], self.body()
                if path.endswith("/info/lfs/objects/batch"):  # /{repo}.git/info/lfs/objects/batch
                    request = json.loads(data)
                    objects = [{"oid": o["oid"], "size": o["size"], "authenticated": True,
                                "actions": {"upload": {"href": f"{stand_in.url}/lfs-upload/{o['oid']}"}}}
                               if o["oid"] not in stand_in.lfs else {"oid": o["oid"], "size": o["size"]}
                               for o in request["objects"]]  # fmt: skip
                    self.reply(200, {"transfer": "basic", "objects": objects})
                    return
                if not self.authorized():
                    return
                if path == "/api/validate-yaml":  # the card's metadata, checked before the commit
                    self.reply(200, {"errors": [], "warnings": []})
                    return
                if path == "/api/repos/create":
                    request = json.loads(data)
                    repo = f"{request.get('organization') or stand_in.user}/{request['name']}"
                    if repo.split("/")[0] != stand_in.user:
                        self.reply(403, {"error": f"You don't have the rights to create a model under the namespace "
                                                  f"\"{repo.split('/')[0]}\""})  # fmt: skip
                        return
                    if repo in stand_in.repos:
                        self.reply(
                            409, {"error": "You already created this model repo", "url": f"{stand_in.url}/{repo}"}
                        )
                        return
                    private = request.get("visibility", "private" if request.get("private") else "public") == "private"
                    stand_in.repos[repo] = {"private": private, "branches": {"main": {}}}
                    self.reply(200, {"url": f"{stand_in.url}/{repo}", "name": repo})
                    return
                parts = path.split("/")  # /api/models/{ns}/{name}/{verb}/{revision}
                if len(parts) < 7 or parts[:3] != ["", "api", "models"]:
                    self.reply(404, {"error": f"unknown route {path}"})
                    return
                repo, verb, revision = f"{parts[3]}/{parts[4]}", parts[5], "/".join(parts[6:]).replace("%2F", "/")
                if repo not in stand_in.repos:
                    self.reply(404, {"error": "Repository not found"})
                    return
                branches = stand_in.repos[repo]["branches"]
                if verb == "branch":
                    branches.setdefault(revision, dict(branches["main"]))
                    self.reply(200, {})
                elif verb == "preupload":
                    files = json.loads(data)["files"]
                    self.reply(200, {"files": [{"path": f["path"], "uploadMode": "lfs" if f["size"] >= LARGE else
                                                "regular", "shouldIgnore": False} for f in files]})  # fmt: skip
                elif verb == "commit":
                    if revision not in branches:
                        self.reply(404, {"error": f"Invalid rev id: {revision}"})
                        return
                    tree = branches[revision]
                    for line in filter(None, data.decode().splitlines()):
                        entry = json.loads(line)
                        value = entry["value"]
                        if entry["key"] == "file":
                            tree[value["path"]] = base64.b64decode(value["content"])
                        elif entry["key"] == "lfsFile":
                            tree[value["path"]] = stand_in.lfs[value["oid"]]
                    oid = hashlib.sha1(json.dumps(sorted(tree)).encode()).hexdigest()
                    self.reply(200, {"commitUrl": f"{stand_in.url}/{repo}/commit/{oid}", "commitOid": oid,
                                     "pullRequestUrl": None})  # fmt: skip
                else:
                    self.reply(404, {"error": f"unknown route {path}"})

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def files(self, repo: str, revision: str = "main") -> dict[str, bytes]:
        return self.repos[repo]["branches"][revision]

    def close(self) -> None:
        self.server.shutdown()
