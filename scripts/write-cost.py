#!/usr/bin/env python3
"""What a write to a big ModelResidency costs the API server, with the status
lists atomic (as the CRD has them) against keyed by name and type (as they
were until 2026-12-04), interleaved in one run.

Usage, against a local control plane (nothing else there is touched but the
namespace `write-cost` and, for the run, the ModelResidency CRD, which is put
back as it was at the end):

    model-residency local-cluster &      # prints `export KUBECONFIG=...`
    KUBECONFIG=... python3 scripts/write-cost.py [--rounds 3] [--models 21] [--writes 100]

Each round and variant: the CRD replaced, one residency of N models created
anew, its status applied as the operator does (server-side apply, field
manager `model-residency`, forced) `--writes` times, then as many demand
merge patches as the router sends; prints each kind's p50 round trip, the
object's size and its managedFields' size. One kept-alive connection on
loopback; figures are ratios within a round (history/README.md).
"""

import argparse
import copy
import http.client
import json
import os
import re
import ssl
import sys
import time

NS = "write-cost"
CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/modelresidencies.residency.dev"
BASE = f"/apis/residency.dev/v1alpha1/namespaces/{NS}/modelresidencies"


class Api:
    def __init__(self, kubeconfig):
        text = open(kubeconfig).read()
        server = re.search(r"server:\s*(\S+)", text).group(1)
        self.token = re.search(r"token:\s*(\S+)", text).group(1)
        host, port = server.split("//")[1].rsplit(":", 1)
        if host not in ("127.0.0.1", "localhost", "[::1]"):
            sys.exit(f"{server} is not a local API server: this script replaces a CRD")
        self.conn = http.client.HTTPSConnection(
            host, int(port), context=ssl._create_unverified_context()
        )

    def __call__(self, method, path, body=None, content_type="application/json", ok=(200, 201)):
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
            body = json.dumps(body)
        self.conn.request(method, path, body=body, headers=headers)
        r = self.conn.getresponse()
        data = r.read()
        if r.status not in ok:
            raise RuntimeError(f"{method} {path}: {r.status} {data[:300]!r}")
        return json.loads(data) if data else None


def keyed(crd):
    """The CRD with status.models and status.conditions keyed by name and type."""
    crd = copy.deepcopy(crd)
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    for field, key in (("models", "name"), ("conditions", "type")):
        s = status["properties"][field]
        s["x-kubernetes-list-type"] = "map"
        s["x-kubernetes-list-map-keys"] = [key]
    return crd


def put_crd(api, crd):
    live = api("GET", CRD)
    crd = copy.deepcopy(crd)
    crd["metadata"] = {"name": live["metadata"]["name"],
                       "resourceVersion": live["metadata"]["resourceVersion"]}
    crd.pop("status", None)
    api("PUT", CRD, crd)
    time.sleep(3)  # the API server re-reads the schema


def residency(n):
    return {
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": "big"},
        "spec": {"nodeName": "node-a", "device": "0", "gpu": {"mode": "env"}, "budget": "80Gi",
                 "models": [{"name": f"m{i}", "size": "6Gi", "template": {"spec": {"containers": [
                     {"name": "server", "image": f"example/m{i}:1"}]}}} for i in range(n)]},
    }


def status(n, k):
    """A status as the operator writes it, one field changed per write."""
    models = [{"name": f"m{i}", "state": "Loaded", "reason": "Ready", "size": "6Gi",
               "message": f"m{i} loaded (6Gi): Ready on node node-a GPU 0",
               "pod": f"big-m{i}", "lastRequested": f"2026-12-04T16:00:{k % 60:02d}.123456Z",
               "lastUsed": "2026-12-04T16:00:00.123456Z", "loadedAt": "2026-12-04T16:00:00Z"}
              for i in range(n)]
    conditions = [{"type": t, "status": s, "reason": r, "message": r,
                   "lastTransitionTime": "2026-12-04T16:00:00Z"}
                  for t, s, r in (("Ready", "True", "AllResidentModelsReady"),
                                  ("Refused", "False", "NoRefusals"),
                                  ("Degraded", "False", "NoLoadFailures"))]
    return {"apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": "big"},
            "status": {"observedGeneration": 1, "models": models, "conditions": conditions}}


def p50_ms(api, writes, write):
    times = []
    for k in range(writes):
        t = time.perf_counter()
        write(k)
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", type=int, default=21)
    ap.add_argument("--writes", type=int, default=100)
    args = ap.parse_args()
    kubeconfig = os.environ.get("KUBECONFIG") or sys.exit("set KUBECONFIG (model-residency local-cluster prints it)")
    api = Api(kubeconfig)
    api("POST", "/api/v1/namespaces", {"metadata": {"name": NS}}, ok=(201, 409))
    original = api("GET", CRD)
    variants = (("keyed", keyed(original)), ("atomic", original))
    print(f"{args.models} models, {args.writes} writes per figure, p50 ms")
    print("round  lists   status apply  demand merge  object B  managedFields B")
    try:
        for rnd in range(1, args.rounds + 1):
            for name, crd in variants:
                put_crd(api, crd)
                api("DELETE", f"{BASE}/big", ok=(200, 404))
                while api("GET", f"{BASE}/big", ok=(200, 404)).get("kind") == "ModelResidency":
                    time.sleep(0.1)
                api("POST", BASE, residency(args.models))
                apply = p50_ms(api, args.writes, lambda k: api(
                    "PATCH", f"{BASE}/big/status?fieldManager=model-residency&force=true",
                    status(args.models, k), "application/apply-patch+yaml"))
                demand = p50_ms(api, args.writes, lambda k: api(
                    "PATCH", f"{BASE}/big?fieldManager=router",
                    {"spec": {"demand": {"m0": f"2026-12-04T16:{k // 60 % 60:02d}:{k % 60:02d}.5Z"}}},
                    "application/merge-patch+json"))
                obj = api("GET", f"{BASE}/big")
                managed = len(json.dumps(obj["metadata"].get("managedFields", [])))
                print(f"{rnd:5}  {name:6}  {apply:12.2f}  {demand:12.2f}  {len(json.dumps(obj)):8}  {managed:15}",
                      flush=True)
    finally:
        put_crd(api, original)
        api("DELETE", f"/api/v1/namespaces/{NS}", ok=(200, 202, 404))


if __name__ == "__main__":
    main()
