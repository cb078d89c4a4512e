#!/usr/bin/env python3
"""Fills a running berth with a small, varied state and records its reads.

Used by tools/make-store-fixture (which starts and stops berth):

    store-fixture.py write BASE TOKEN OUT_DIR

writes OUT_DIR/reads.json: every read the layout test repeats on a newer
berth (path, status, body), in order. Standard library only.
"""
import json
import sys
import time
import urllib.error
import urllib.request


def call(base, token, method, path, body=None, headers=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("Authorization", "Bearer " + token)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_idle(base, token, ids):
    """Until no build of these deployments is queued or running."""
    for _ in range(600):
        busy = False
        for d in ids:
            status, body = call(base, token, "GET", f"/v1/deployments/{d}/builds")
            if status != 200:
                continue
            for b in json.loads(body)["items"]:
                busy |= b["status"] in ("queued", "running")
        if not busy:
            return
        time.sleep(0.1)
    raise SystemExit("builds did not finish")


def write(base, token, out):
    alice = {"subject": "alice@example.org", "issuer": "https://id.example.org"}
    ops = {"subject": "ops"}

    def as_actor(actor):
        h = {"X-Actor-Subject": actor["subject"]}
        if "issuer" in actor:
            h["X-Actor-Issuer"] = actor["issuer"]
        return h

    def ok(status, body, want=202):
        if status != want:
            raise SystemExit(f"unexpected {status}: {body[:300]!r}")
        return json.loads(body) if body else None

    apps = {"mastodon": {"enable": True}, "forgejo": {"enable": True}}
    ok(*call(base, token, "POST", "/v1/deployments/alice/submit",
             {"configuration": {"domain": "alice.example.org", "applications": apps}},
             {**as_actor(alice), "Idempotency-Key": "fixture-submit-000001"}))
    ok(*call(base, token, "POST", "/v1/deployments/bob/submit",
             {"configuration": {"domain": "bob.example.org",
                                "applications": {"homepage": {"enable": True}}}},
             as_actor(ops)))
    ok(*call(base, token, "POST", "/v1/deployments/carol/submit",
             {"configuration": {"domain": "carol.example.org"}}, as_actor(ops)))
    wait_idle(base, token, ["alice", "bob", "carol"])
    # A second deploy of alice (changes one node), then suspend and resume.
    apps2 = {"mastodon": {"enable": True}, "forgejo": {"enable": True},
             "homepage": {"enable": True}}
    ok(*call(base, token, "POST", "/v1/deployments/alice/submit",
             {"configuration": {"domain": "alice.example.org", "applications": apps2}},
             as_actor(alice)))
    wait_idle(base, token, ["alice"])
    ok(*call(base, token, "POST", "/v1/deployments/alice/actions/suspend", None, as_actor(alice)))
    wait_idle(base, token, ["alice"])
    ok(*call(base, token, "POST", "/v1/deployments/alice/actions/resume", None, as_actor(alice)))
    wait_idle(base, token, ["alice"])
    # A refused submit (audited, stores no build).
    call(base, token, "POST", "/v1/deployments/bob/submit",
         {"configuration": {"domain": 7}}, as_actor(ops))
    # A queued build cancelled before it ran.
    queued = ok(*call(base, token, "POST", "/v1/deployments/bob/submit",
                      {"configuration": {"domain": "bob.example.org"}, "mode": "enqueue"},
                      as_actor(ops)))
    call(base, token, "POST", f"/v1/builds/{queued['build_id']}/cancel", None, as_actor(ops))
    wait_idle(base, token, ["bob"])
    # An update policy, and carol destroyed.
    ok(*call(base, token, "PUT", "/v1/deployments/bob/update-policy",
             {"kind": "window", "frequency": "weekly", "day": 7, "start": "03:00",
              "duration_minutes": 120, "time_zone": "Europe/Amsterdam"},
             as_actor(ops)), want=200)
    ok(*call(base, token, "DELETE", "/v1/deployments/carol", None, as_actor(ops)))
    wait_idle(base, token, ["carol"])

    reads = []

    def read(path):
        status, body = call(base, token, "GET", path)
        try:
            value = json.loads(body)
            kind = "json"
        except ValueError:
            value = body.decode()
            kind = "text"
        reads.append({"path": path, "status": status, "kind": kind, "body": value})
        return value

    listing = read("/v1/deployments")
    for d in [x["id"] for x in listing["items"]]:
        read(f"/v1/deployments/{d}")
        builds = read(f"/v1/deployments/{d}/builds")
        for b in builds.get("items", []):
            read(f"/v1/builds/{b['id']}")
            read(f"/v1/builds/{b['id']}/log")
        sboms = read(f"/v1/deployments/{d}/sboms")
        for n in sboms.get("nodes", []):
            read(f"/v1/deployments/{d}/sboms/{n['node']}")
    read("/v1/audit?actor_subject=alice%40example.org&actor_issuer=https%3A%2F%2Fid.example.org")
    read("/v1/audit?actor_subject=ops")
    with open(f"{out}/reads.json", "w") as f:
        json.dump(reads, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "write":
        raise SystemExit(__doc__)
    write(sys.argv[2], sys.argv[3], sys.argv[4])
