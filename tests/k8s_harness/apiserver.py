"""A Kubernetes API server subset over real HTTPS on 127.0.0.1, in front of :class:`store.Store`.

Served: namespaced ``create``/``get``/``list``/``update``/``patch`` (JSON merge patch)/``delete`` of
every kind in :data:`store.KINDS` (core ``/api/v1``, groups ``/apis/<group>/<version>``), cluster-scoped
kinds, ``pods/<name>/log`` (``container``, ``tailLines``; ``follow`` answers what there is and
ends), events (the controllers' events as core/v1 Events, ``fieldSelector`` on ``involvedObject.*``),
``/version`` (:data:`cluster.KUBE_VERSION`), legacy discovery (``/api``, ``/apis``, each group
version's resource list), and ``meta.k8s.io/v1`` Tables when the client asks for them
(:mod:`tables`) — enough for the real ``kubectl`` (1.32) to run ``get``, ``describe``, ``logs`` and
``create -f --validate=false`` against it. Not served: watch, server-side apply, aggregated discovery (kubectl falls
back to the legacy form) and OpenAPI documents. Request bodies may be JSON, or protobuf for create and
update — what kubectl's typed commands (``create job``, ``create job --from=cronjob/…``) send —, decoded
with the schema registered in the kubectl binary itself (:mod:`protobuf`); answers are always JSON, which
those clients accept beside protobuf.

What it enforces, like a real API server:

* **Authentication**: bearer tokens only — the test's admin token, and one token per ServiceAccount
  (what a pod gets in its kubeconfig); anything else is 401.
* **Authorization**: a ServiceAccount may do only what the Roles bound to it by RoleBindings in its
  namespace allow (apiGroups, resources incl. subresources such as ``pods/log``, verbs, resourceNames);
  otherwise 403 with the API's message. The chart's Role is what the driver runs under.
* **Validation**: created and updated objects are checked with ``kubernetes-validate`` against the
  Kubernetes OpenAPI schema (unknown fields are errors when the request says ``fieldValidation=Strict``),
  JobSets against the vendored CRD schema (tests/assets/crds); names as the API checks them (a DNS label
  for Services, at most 63 characters for Jobs, 52 for CronJobs); immutable fields on update (Job
  spec except parallelism/suspend/deadlines/TTL/backoffLimit/maxFailedIndexes, Service clusterIP,
  PVC spec except the storage request) → 422 "field is immutable".
"""

from __future__ import annotations

import json
import re
import ssl
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import protobuf
from .store import BY_PLURAL, KINDS, SHORT_NAMES, Conflict, Invalid, Kind, NotFound
from .tables import table

if TYPE_CHECKING:
    from .cluster import Cluster

CRD_DIR = Path(__file__).resolve().parents[1] / "assets" / "crds"
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_JOB_MUTABLE = {"parallelism", "suspend", "activeDeadlineSeconds", "ttlSecondsAfterFinished", "backoffLimit",
                "maxFailedIndexes"}


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def crd_schema(kind: Kind) -> dict | None:
    """The openAPIV3Schema of a vendored CRD (tests/assets/crds/<group>_<plural>.yaml), for its version."""
    import yaml
    path = CRD_DIR / f"{kind.group}_{kind.plural}.yaml"
    if not path.exists():
        return None
    crd = yaml.safe_load(path.read_text())
    for v in crd["spec"]["versions"]:
        if v["name"] == kind.version:
            return v["schema"]["openAPIV3Schema"]
    return None


def validate_crd(obj: dict, schema: dict, strict: bool = True) -> list[str]:
    """Structural-schema validation of a custom resource: types, enums, required, and (strict) no
    field the schema does not declare unless it says x-kubernetes-preserve-unknown-fields."""
    import jsonschema

    def tighten(s: Any) -> Any:
        if isinstance(s, dict):
            s = {k: tighten(v) for k, v in s.items() if not k.startswith("x-kubernetes-")
                 or k == "x-kubernetes-preserve-unknown-fields"}
            if strict and s.get("type") == "object" and "properties" in s and "additionalProperties" not in s \
                    and not s.get("x-kubernetes-preserve-unknown-fields"):
                s["additionalProperties"] = False
            if s.get("x-kubernetes-int-or-string"):
                s.pop("type", None)
            s.pop("x-kubernetes-preserve-unknown-fields", None)
            return s
        if isinstance(s, list):
            return [tighten(v) for v in s]
        return s
    body = {k: v for k, v in obj.items() if k != "status"}
    validator = jsonschema.Draft7Validator(tighten(schema))
    return [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(body)]


class ApiServer:
    def __init__(self, cluster: "Cluster", cert: Path, key: Path) -> None:
        self.cluster = cluster
        handler = type("Handler", (_Handler,), {"api": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="harness-apiserver", daemon=True)
        self.requests: list[tuple[str, str, str, int]] = []  # (user, method, path, status)
        self._crd_schemas: dict[str, dict | None] = {}

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -------------------------------------------------------------------------------- auth

    def authorize(self, user: str, verb: str, group: str, resource: str, namespace: str | None,
                  name: str | None) -> None:
        if user == "admin":
            return
        m = re.fullmatch(r"system:serviceaccount:([^:]+):([^:]+)", user)
        if not m:
            raise ApiError(403, "Forbidden", f'User "{user}" cannot {verb} resource "{resource}"')
        sa_ns, sa = m.groups()
        store = self.cluster.store
        if namespace == sa_ns:
            for rb in store.list("RoleBinding", namespace):
                if not any(s.get("kind") == "ServiceAccount" and s.get("name") == sa
                           and s.get("namespace", namespace) == sa_ns for s in rb.get("subjects") or []):
                    continue
                ref = rb["roleRef"]
                if ref["kind"] != "Role":
                    continue
                role = store.get("Role", namespace, ref["name"])
                for rule in (role or {}).get("rules") or []:
                    if (("*" in rule.get("apiGroups", []) or group in rule.get("apiGroups", []))
                            and ("*" in rule.get("resources", []) or resource in rule.get("resources", []))
                            and ("*" in rule.get("verbs", []) or verb in rule.get("verbs", []))
                            and (not rule.get("resourceNames") or name in rule["resourceNames"])):
                        return
        gr = f'"{resource.split("/")[0]}"' + (f' in API group "{group}"' if group else ' in API group ""')
        sub = f' subresource "{resource.split("/")[1]}"' if "/" in resource else ""
        raise ApiError(403, "Forbidden", f'{resource.split("/")[0]} is forbidden: User "{user}" cannot {verb} '
                                         f'resource {gr}{sub}' + (f' in the namespace "{namespace}"' if namespace else ""))

    # -------------------------------------------------------------------------------- validation

    def validate(self, kind: Kind, obj: dict, strict: bool) -> None:
        name = obj.get("metadata", {}).get("name", "")
        problems: list[str] = []
        if kind.kind == "Service" and not (_DNS_LABEL.match(name) and len(name) <= 63):
            problems.append(f"metadata.name: Invalid value: {name!r}: a DNS-1035 label must consist of lower case "
                            "alphanumeric characters or '-', start with a letter, and be at most 63 characters")
        elif name and not (_DNS_SUBDOMAIN.match(name) and len(name) <= 253):
            problems.append(f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain")
        limit = {"Job": 63, "CronJob": 52, "JobSet": 63}.get(kind.kind)
        if limit and len(name) > limit:
            problems.append(f"metadata.name: Invalid value: {name!r}: must be no more than {limit} characters")
        for _k, v in (obj.get("metadata", {}).get("labels") or {}).items():
            if len(str(v)) > 63:
                problems.append(f"metadata.labels: Invalid value: {v!r}: must be no more than 63 characters")
        if kind.group == "jobset.x-k8s.io":
            if kind.kind not in self._crd_schemas:
                self._crd_schemas[kind.kind] = crd_schema(kind)
            schema = self._crd_schemas[kind.kind]
            if schema is None:
                raise ApiError(404, "NotFound", f"the server could not find the requested resource ({kind.plural})")
            problems += validate_crd(obj, schema, strict)
        else:
            import kubernetes_validate
            try:
                kubernetes_validate.validate(obj, self.cluster.kube_version, strict=strict)
            except kubernetes_validate.ValidationError as e:
                problems.append(str(e).strip().splitlines()[0])
            except kubernetes_validate.SchemaNotFoundError:
                pass
        if problems:
            raise ApiError(422, "Invalid", f'{kind.kind} "{name}" is invalid: ' + "; ".join(problems))

    @staticmethod
    def check_immutable(kind: Kind, old: dict, new: dict) -> None:
        name = old["metadata"]["name"]
        if kind.kind == "Job":
            changed = sorted(k for k in set(old.get("spec", {})) | set(new.get("spec", {}))
                             if k not in _JOB_MUTABLE and old["spec"].get(k) != new.get("spec", {}).get(k))
            if changed:
                raise ApiError(422, "Invalid", f'Job.batch "{name}" is invalid: spec.{changed[0]}: Invalid value: '
                                               "field is immutable")
        if kind.kind == "Service" and old["spec"].get("clusterIP") != new.get("spec", {}).get("clusterIP", old["spec"].get("clusterIP")):
            raise ApiError(422, "Invalid", f'Service "{name}" is invalid: spec.clusterIP: Invalid value: field is immutable')
        if kind.kind == "PersistentVolumeClaim":
            a = {k: v for k, v in old.get("spec", {}).items() if k != "resources"}
            b = {k: v for k, v in new.get("spec", {}).items() if k != "resources"}
            if a != b:
                raise ApiError(422, "Invalid", f'PersistentVolumeClaim "{name}" is invalid: spec: Forbidden: spec is '
                                               "immutable after creation except resources.requests")


_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
_CATEGORY_ALL = {"pods", "services", "jobs", "cronjobs", "deployments"}


def discovery(path: str, server: str) -> dict | None:
    """Legacy discovery documents: /api, /apis, /api/v1, /apis/<group>[/<version>]; None if not one."""
    groups: dict[str, set[str]] = {}
    for k in KINDS:
        groups.setdefault(k.group, set()).add(k.version)
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server}]}

    def group_doc(g: str) -> dict:
        vs = [{"groupVersion": f"{g}/{v}", "version": v} for v in sorted(groups[g])]
        return {"name": g, "versions": vs, "preferredVersion": vs[0]}
    if path == "/apis":
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [group_doc(g) for g in sorted(groups) if g]}
    m = re.fullmatch(r"/apis/([^/]+)", path)
    if m and m.group(1) in groups and m.group(1):
        return {"kind": "APIGroup", "apiVersion": "v1", **group_doc(m.group(1))}
    m = re.fullmatch(r"/api/(v1)|/apis/([^/]+)/([^/]+)", path)
    if not m:
        return None
    group, version = ("", "v1") if m.group(1) else (m.group(2), m.group(3))
    if version not in groups.get(group, set()):
        return None
    resources = []
    for k in KINDS:
        if (k.group, k.version) != (group, version):
            continue
        resources.append({"name": k.plural, "singularName": k.kind.lower(), "namespaced": k.namespaced,
                          "kind": k.kind, "verbs": _VERBS, "shortNames": SHORT_NAMES.get(k.plural, []),
                          **({"categories": ["all"]} if k.plural in _CATEGORY_ALL else {})})
        if k.kind in ("Pod", "Job", "CronJob", "JobSet", "Deployment"):
            resources.append({"name": f"{k.plural}/status", "singularName": "", "namespaced": True, "kind": k.kind,
                              "verbs": ["get", "patch", "update"]})
        if k.kind == "Pod":
            resources.append({"name": "pods/log", "singularName": "", "namespaced": True, "kind": "Pod",
                              "verbs": ["get"]})
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources}


def event_objects(events: list[dict], namespace: str | None, field_selector: str | None) -> list[dict]:
    """The controllers' events (Store.event) as core/v1 Events, filtered as ``fieldSelector`` asks."""
    want = dict(p.split("=", 1) for p in (field_selector or "").split(",") if "=" in p)
    out = []
    for i, e in enumerate(events):
        inv = {"kind": e["kind"], "name": e["name"], "namespace": e.get("namespace", ""), "uid": e.get("uid", ""),
               "apiVersion": e.get("apiVersion", "")}
        if namespace and inv["namespace"] not in (namespace, ""):
            continue
        if any(inv.get(k.split(".", 1)[1]) != v for k, v in want.items() if k.startswith("involvedObject.")):
            continue
        t = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(e["time"]))
        out.append({"apiVersion": "v1", "kind": "Event",
                    "metadata": {"name": f"{e['name']}.{i:016x}", "namespace": inv["namespace"],
                                 "creationTimestamp": t, "uid": f"event-{i}", "resourceVersion": str(i + 1)},
                    "involvedObject": inv, "reason": e["reason"], "message": e["message"], "type": e["type"],
                    "count": 1, "firstTimestamp": t, "lastTimestamp": t,
                    "source": {"component": "job-controller" if e["kind"] == "Job" else "harness"}})
    return out


def strip_null_timestamps(obj: Any) -> Any:
    """Drop ``creationTimestamp: null`` (what clients send in new objects and templates), as the API
    server ignores it; the schema would refuse a null."""
    if isinstance(obj, dict):
        return {k: strip_null_timestamps(v) for k, v in obj.items() if not (k == "creationTimestamp" and v is None)}
    if isinstance(obj, list):
        return [strip_null_timestamps(v) for v in obj]
    return obj


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class _Handler(BaseHTTPRequestHandler):
    api: ApiServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, obj: Any, ctype: str = "application/json") -> None:
        data = obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str, message: str) -> None:
        self._send(code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                          "message": message, "reason": reason, "code": code})

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def _user(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return None
        return self.api.cluster.tokens.get(auth[len("Bearer "):].strip())

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        parts = urllib.parse.urlsplit(self.path)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(parts.query).items()}
        user = self._user()
        code = 500
        try:
            if parts.path == "/version":
                code = 200
                major, minor, _ = self.api.cluster.kube_version.split(".")
                return self._send(200, {"major": major, "minor": minor, "gitVersion": f"v{self.api.cluster.kube_version}",
                                        "platform": "linux/amd64"})
            if user is None:
                raise ApiError(401, "Unauthorized", "Unauthorized")
            doc = discovery(parts.path.rstrip("/"), f"127.0.0.1:{self.api.port}") if method == "GET" else None
            if doc is not None:
                code = 200
                return self._send(200, doc)
            ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
            if raw and ctype == protobuf.MEDIA_TYPE and method in ("POST", "PUT"):
                try:  # kubectl's typed commands: decoded with kubectl's own schema (protobuf.py)
                    body = strip_null_timestamps(protobuf.decode_object(raw, self.api.cluster.kube_version))
                except protobuf.ProtobufError as e:
                    raise ApiError(400, "BadRequest", f"the protobuf body cannot be decoded: {e}") from e
            elif raw and "protobuf" in ctype:
                raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - "
                               "accepted media types include: application/json, application/merge-patch+json, "
                               f"{protobuf.MEDIA_TYPE} (create and update)")
            else:
                body = strip_null_timestamps(json.loads(raw)) if raw.strip() else None
            code = self._route(method, parts.path, query, body, user)
        except ApiError as e:
            code = e.code
            self._status(e.code, e.reason, e.message)
        except NotFound as e:
            code = 404
            self._status(404, "NotFound", str(e))
        except Conflict as e:
            code = 409
            self._status(409, "AlreadyExists", str(e))
        except Invalid as e:
            code = 422
            self._status(422, "Invalid", str(e))
        finally:
            self.api.requests.append((user or "anonymous", method, parts.path, code))

    def _route(self, method: str, path: str, query: dict[str, str], body: Any, user: str) -> int:
        m = re.fullmatch(r"/api/v1(?:/namespaces/([^/]+))?/([^/]+)(?:/([^/]+)(?:/([^/]+))?)?", path) or \
            re.fullmatch(r"/apis/([^/]+)/([^/]+)(?:/namespaces/([^/]+))?/([^/]+)(?:/([^/]+)(?:/([^/]+))?)?", path)
        if not m:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        if path.startswith("/api/v1"):
            group, version = "", "v1"
            ns, plural, name, sub = m.groups()
        else:
            group, version, ns, plural, name, sub = m.groups()
        if plural == "namespaces" and ns is None and name is not None and sub is None and group == "":
            plural, ns, name = "namespaces", None, name
        kind = BY_PLURAL.get((group, plural))
        if kind is None or kind.version != version:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        verb = {"GET": "get" if name else ("watch" if query.get("watch") in ("true", "1") else "list"),
                "POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if name else "deletecollection"}[method]
        resource = plural + (f"/{sub}" if sub else "")
        self.api.authorize(user, verb, group, resource, ns, name)
        store = self.api.cluster.store
        if verb == "watch":
            raise ApiError(405, "MethodNotAllowed", "watch is not served by the harness")
        as_table = "as=Table" in self.headers.get("Accept", "")
        if sub == "log" and kind.kind == "Pod":
            if store.get("Pod", ns, name) is None:
                raise NotFound(f'pods "{name}" not found')
            text = self.api.cluster.kubelet.log_text(ns, name, query.get("container"))
            if "tailLines" in query:
                lines = text.splitlines(keepends=True)
                text = "".join(lines[-int(query["tailLines"]):]) if int(query["tailLines"]) > 0 else ""
            self._send(200, text, "text/plain")
            return 200
        if sub not in (None, "status"):
            raise ApiError(404, "NotFound", f"subresource {sub} is not served by the harness")
        strict = query.get("fieldValidation") == "Strict"
        if method == "POST":
            if not isinstance(body, dict) or body.get("kind") != kind.kind:
                raise ApiError(400, "BadRequest", f"the body is not a {kind.kind}")
            if ns and body.get("metadata", {}).get("namespace") not in (None, ns):
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the "
                                                  "namespace sent on the request")
            obj = self.api.cluster.create(body, ns, validate=True, strict=strict)
            self._send(201, obj)
            return 201
        if method == "GET" and name is None:
            items = store.list(kind.kind, ns, query.get("labelSelector"))
            if kind.kind == "Event":
                items += event_objects(store.events, ns, query.get("fieldSelector"))
            if as_table:
                self._send(200, table(kind.kind, items))
            else:
                self._send(200, {"kind": f"{kind.kind}List", "apiVersion": kind.api_version,
                                 "metadata": {"resourceVersion": "1"}, "items": items})
            return 200
        obj = store.get(kind.kind, ns, name)
        if obj is None:
            raise NotFound(f'{plural}{"." + group if group else ""} "{name}" not found')
        if method == "GET":
            self._send(200, table(kind.kind, [obj]) if as_table and sub is None else obj)
            return 200
        if method in ("PUT", "PATCH"):
            new = body if method == "PUT" else merge_patch(obj, body)
            if kind.kind == "Job" and sub is None:  # the API server defaults an update as it does a create
                from .admission import default_job
                new = default_job({**new, "metadata": {**new.get("metadata", {}), "name": name}}, obj["metadata"]["uid"])
            self.api.validate(kind, new, strict)
            if sub == "status":
                out = store.update({**obj, "status": new.get("status", {})}, status_only=True)
            else:
                self.api.check_immutable(kind, obj, new)
                out = store.update(new)
            self._send(200, out)
            return 200
        if method == "DELETE":
            policy = query.get("propagationPolicy") or (body or {}).get("propagationPolicy")
            out = store.delete(kind.kind, ns, name, policy)
            self._send(200, out)
            return 200
        raise ApiError(405, "MethodNotAllowed", method)
