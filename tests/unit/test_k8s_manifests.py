"""The Kubernetes manifests in k8s/: KubeRay resources valid against the CRD schemas, the Serve
config valid the way Serve reads it, and the pieces wired to each other (selectors, ports, Redis,
drafters, import paths)."""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S = REPO_ROOT / "k8s"
# The KubeRay CRDs, vendored (k8s/schemas/kuberay/SOURCE.md: where from, under which licence).
SCHEMAS = K8S / "schemas" / "kuberay"
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
# Labels KubeRay itself puts on Ray pods; a Service may select on them besides the template's.
KUBERAY_POD_LABELS = {"ray.io/serve": "true", "ray.io/node-type": None}  # None: any value
TLS_SECRET = "specpool-grpc-tls"  # kubernetes.io/tls, made by cert-manager (k8s/examples/certificate.yaml) or by hand
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# -- loading ----------------------------------------------------------------------------------------
def manifest_files() -> list[Path]:
    return sorted([*K8S.glob("*.yaml"), *K8S.glob("*.yml")])


@functools.cache
def _documents() -> tuple[tuple[str, dict], ...]:
    docs = []
    for path in manifest_files():
        for doc in yaml.load_all(path.read_text(), Loader=_Loader):
            if doc is not None:
                docs.append((path.name, doc))
    return tuple(docs)


def documents(kind: str | None = None) -> list[dict]:
    return [copy.deepcopy(doc) for _, doc in _documents() if kind is None or doc.get("kind") == kind]


def ray_service() -> dict:
    (service,) = documents("RayService")
    return service


def serve_config(service: dict | None = None) -> dict:
    return yaml.safe_load((service or ray_service())["spec"]["serveConfigV2"])


def applications() -> dict[str, dict]:
    return {app["name"]: app for app in serve_config()["applications"]}


def import_paths() -> list[str]:
    """Every Serve ``import_path`` in k8s/ (the application builders), sorted and distinct."""
    paths = set()
    for service in documents("RayService"):
        paths.update(app["import_path"] for app in serve_config(service)["applications"])
    return sorted(paths)


def _resolve(path: str):
    """Import ``module:attr`` (Serve's import_path) or ``module.attr`` (a servicer function)."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


# -- CRD schemas ------------------------------------------------------------------------------------
def _closed(schema):
    """The schema with unknown fields rejected where the CRD lists the allowed ones.

    The API server silently prunes unknown fields of a structural schema, so a misspelt field
    would be dropped without a word; validation here treats it as the error it is.
    """
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _closed(value) if key in ("items", "additionalProperties", "anyOf", "allOf", "oneOf", "not") else value
           for key, value in schema.items()}
    if "properties" in out:
        out["properties"] = {name: _closed(sub) for name, sub in schema["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


@functools.cache
def _crd(kind: str) -> dict:
    """The vendored CRD of ``kind`` (about 1 MB of YAML each: read once per run)."""
    return yaml.load((SCHEMAS / CRD_FILES[kind]).read_text(), Loader=_Loader)


@functools.cache
def crd_validator(kind: str, version: str):
    crd = _crd(kind)
    assert crd["spec"]["names"]["kind"] == kind
    versions = {v["name"]: v for v in crd["spec"]["versions"]}
    assert version in versions, f"{kind} CRD has no version {version}; it has {sorted(versions)}"
    schema = _closed(versions[version]["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def crd_errors(doc: dict) -> list[str]:
    group, _, version = doc["apiVersion"].partition("/")
    assert group == "ray.io", doc["apiVersion"]
    validator = crd_validator(doc["kind"], version)
    return [
        f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


def _crd_docs() -> list[pytest.param]:
    return [pytest.param(doc, id=f"{name}:{doc['kind']}/{doc['metadata']['name']}")
            for name, doc in _documents() if doc.get("kind") in CRD_FILES]


def test_the_vendored_crds_say_where_they_come_from():
    assert sorted(p.name for p in SCHEMAS.iterdir()) == ["LICENSE", "SOURCE.md", *sorted(CRD_FILES.values())]
    assert "Apache License" in (SCHEMAS / "LICENSE").read_text()
    source = (SCHEMAS / "SOURCE.md").read_text()
    assert "ray-project/kuberay" in source and re.search(r"\b[0-9a-f]{40}\b", source), "SOURCE.md names the repository and commit"
    for kind, file in CRD_FILES.items():
        crd = _crd(kind)
        assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["group"] == "ray.io", file
        assert crd["spec"]["names"]["kind"] == kind, file


def test_every_crd_document_in_k8s_is_validated():
    """Every KubeRay resource in k8s/ is a RayService or RayCluster, so the schema test sees it."""
    ray_kinds = {doc["kind"] for _, doc in _documents() if doc["apiVersion"].startswith("ray.io/")}
    assert ray_kinds and ray_kinds <= set(CRD_FILES), ray_kinds
    assert len(_crd_docs()) == sum(1 for _, doc in _documents() if doc["apiVersion"].startswith("ray.io/"))


def test_every_manifest_is_a_kubernetes_object():
    assert manifest_files(), f"no manifests in {K8S}"
    seen = set()
    for name, doc in _documents():
        assert isinstance(doc, dict), f"{name}: a document is not a mapping"
        for key in ("apiVersion", "kind", "metadata"):
            assert key in doc, f"{name}: {doc.get('kind', '?')} lacks {key}"
        ident = (doc["kind"], doc["metadata"].get("name"))
        assert ident[1], f"{name}: {doc['kind']} has no metadata.name"
        assert ident not in seen, f"{name}: duplicate {ident}"
        seen.add(ident)
    kinds = [kind for kind, _ in seen]
    assert kinds.count("RayService") == 1 and "Deployment" in kinds and kinds.count("Service") >= 2, kinds


@pytest.mark.parametrize("doc", _crd_docs())
def test_kuberay_resources_match_the_crd_schema(doc):
    assert crd_errors(doc) == []


def test_schema_validation_rejects_a_wrong_field_type():
    doc = ray_service()
    assert crd_errors(doc) == []
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["minReplicas"] = "zero"
    errors = crd_errors(doc)
    assert any("minReplicas" in e and "'zero' is not of type 'integer'" in e for e in errors), errors


def test_schema_validation_rejects_misspelt_and_missing_fields():
    doc = ray_service()
    group = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["maxReplica"] = group.pop("maxReplicas")  # misspelt: the API server would drop it
    errors = crd_errors(doc)
    assert any("'maxReplica' was unexpected" in e for e in errors), errors
    assert any("'maxReplicas' is a required property" in e for e in errors), errors


# -- Serve config -----------------------------------------------------------------------------------
def test_serve_config_applications_are_well_formed():
    apps = serve_config()["applications"]
    names = [app.get("name") for app in apps]
    assert all(names) and len(set(names)) == len(names), names
    routes = []
    for app in apps:
        assert "route_prefix" in app, f"{app['name']}: say route_prefix (a path, or null for no HTTP route)"
        route = app["route_prefix"]
        if route is not None:
            assert isinstance(route, str) and route.startswith("/"), f"{app['name']}: route_prefix {route!r}"
            assert route == "/" or not route.endswith("/"), f"{app['name']}: route_prefix {route!r} ends with /"
            assert "{" not in route and "}" not in route
            routes.append(route)
        assert IMPORT_PATH.match(app.get("import_path", "")), f"{app['name']}: import_path {app.get('import_path')!r}"
        assert isinstance(app.get("args", {}), dict)
    assert len(set(routes)) == len(routes), routes


def test_serve_config_passes_serves_own_schema():
    from ray.serve.schema import ServeDeploySchema  # ray[serve] is a runtime dependency

    validated = ServeDeploySchema.model_validate(serve_config())
    assert sorted(app.name for app in validated.applications) == sorted(applications())


def test_only_the_router_is_exposed():
    """One exposed application: Serve's gRPC proxy then routes without `application` metadata."""
    exposed = [name for name, app in applications().items() if app["route_prefix"] is not None]
    assert exposed == ["router"]
    assert applications()["router"]["import_path"] == "specpool.services.serve_app:build_router_app"


def test_grpc_options_point_at_the_specpool_servicer():
    options = serve_config()["grpc_options"]
    assert options["port"] == 9000
    functions = options["grpc_servicer_functions"]
    assert "specpool.services.grpc_ingress.add_specpool_servicer_to_server" in functions
    for function in functions:
        assert callable(_resolve(function)), function


def test_router_args_and_the_pool():
    apps = applications()
    args = apps["router"]["args"]
    for key in ("redis_url_env", "policy", "k"):
        assert key in args, f"router args lack {key}"
    assert isinstance(args["k"], int) and 1 <= args["k"] <= 32
    target = apps[args["target_app"]]
    assert target["import_path"] == "specpool.services.serve_app:build_target_app"
    drafter_apps = {name: app for name, app in apps.items() if app["import_path"] == "specpool.services.serve_app:build_drafter_app"}
    assert drafter_apps, "no drafter applications"
    # The router's pool and the drafter applications agree, both ways.
    assert set(args["drafter_apps"].values()) == set(drafter_apps)
    for drafter, app_name in args["drafter_apps"].items():
        assert drafter_apps[app_name]["args"]["name"] == drafter
    for app in [target, *drafter_apps.values(), apps["router"]]:
        assert isinstance(app["args"]["num_replicas"], int) and app["args"]["num_replicas"] >= 1, app["name"]
        options = app["args"]["ray_actor_options"]
        assert {"num_cpus", "num_gpus"} <= set(options), app["name"]
        assert options["num_cpus"] >= 0 and options["num_gpus"] >= 0, app["name"]


def test_replicas_fit_the_cpu_workers():
    service = ray_service()
    groups = {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    cpu = groups["cpu-workers"]
    (container,) = cpu["template"]["spec"]["containers"]
    per_node = float(container["resources"]["limits"]["cpu"])
    wanted = sum(app["args"]["num_replicas"] * app["args"]["ray_actor_options"]["num_cpus"]
                 for app in applications().values()
                 if app["args"]["ray_actor_options"]["num_gpus"] == 0)
    assert wanted <= per_node * cpu["maxReplicas"], f"{wanted} CPUs wanted, cpu-workers give at most {per_node * cpu['maxReplicas']}"


# -- Ray cluster shape ------------------------------------------------------------------------------
def test_head_and_worker_groups():
    cluster = ray_service()["spec"]["rayClusterConfig"]
    assert "template" in cluster["headGroupSpec"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"cpu-workers", "gpu-workers"}
    for name, group in groups.items():
        assert group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"], name
    gpu = groups["gpu-workers"]
    assert gpu["minReplicas"] == 0
    (container,) = gpu["template"]["spec"]["containers"]
    for part in ("requests", "limits"):
        assert int(container["resources"][part]["nvidia.com/gpu"]) == 1, part
    tolerations = gpu["template"]["spec"].get("tolerations", [])
    assert any(t.get("key") == "nvidia.com/gpu" for t in tolerations), tolerations
    assert cluster.get("enableInTreeAutoscaling") is True, "a group at 0 nodes only grows with the autoscaler"
    cpu_container = groups["cpu-workers"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in cpu_container["resources"].get("limits", {})


def _ray_containers(service: dict) -> list[dict]:
    """The Ray container of every node group (KubeRay runs Ray in the first container; others are sidecars)."""
    cluster = service["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
    return [t["spec"]["containers"][0] for t in templates]


def _all_containers() -> list[tuple[str, dict]]:
    return [(f"{owner}/{c['name']}", c) for owner, t in pod_templates() for c in t["spec"]["containers"]]


def test_one_image_everywhere():
    """Ray containers, the TLS sidecar and the learner run the one specpool image (Redis its own)."""
    images = {c["image"] for owner, c in _all_containers() if not owner.startswith("Deployment/specpool-redis")}
    assert len(images) == 1, images
    assert re.match(r"^[\w.-]+(/[\w.-]+)+:[\w.-]+$", images.pop()), "an image with an explicit tag"


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in env values, command and args (an unknown VAR stays as is)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def _expanded_env(container: dict) -> dict[str, str]:
    """The container's environment as Kubernetes builds it: in order, each value's $(VAR) of an
    earlier entry expanded; a value from a Secret shows as <NAME>."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        env[entry["name"]] = _expand(entry["value"], env) if "value" in entry else f"<{entry['name']}>"
    return env


def _secret_ref(entry: dict) -> tuple[str, str] | None:
    ref = entry.get("valueFrom", {}).get("secretKeyRef")
    return (ref["name"], ref["key"]) if ref else None


REDIS_URL = re.compile(r"^redis://(?P<user>[\w-]+):\$\(REDIS_PASSWORD\)@(?P<host>[\w.-]+):(?P<port>\d+)/(?P<db>\d+)$")


def redis_clients() -> list[tuple[str, dict]]:
    """Every container that talks to Redis: each Ray container (the routers) and the learner."""
    return [(f"ray:{c['name']}", c) for c in _ray_containers(ray_service())] + [
        (f"learner:{c['name']}", c) for c in learner()["spec"]["template"]["spec"]["containers"]]


def test_redis_url_comes_from_the_secret_and_names_the_redis_service():
    """The router reads its URL from REDIS_URL (serveConfigV2 cannot expand variables, and a
    password there would show in the Serve config); every client builds it from Secret
    specpool-redis, as the ACL user Redis defines, for the Redis Service."""
    args = applications()["router"]["args"]
    assert args.get("redis_url_env") == "REDIS_URL" and "redis_url" not in args, args
    urls = set()
    for owner, container in redis_clients():
        env = _env(container)
        names = list(env)
        assert _secret_ref(env["REDIS_PASSWORD"]) == ("specpool-redis", "password"), owner
        # $(REDIS_PASSWORD) expands only when REDIS_PASSWORD is defined earlier in the list.
        assert names.index("REDIS_PASSWORD") < names.index("REDIS_URL"), owner
        urls.add(env["REDIS_URL"]["value"])
    assert len(urls) == 1, urls
    match = REDIS_URL.match(urls.pop())
    assert match, f"REDIS_URL must be redis://USER:$(REDIS_PASSWORD)@HOST:PORT/DB"
    services = {s["metadata"]["name"]: s for s in documents("Service")}
    assert match["host"] in services, f"{match['host']} is not a Service in k8s/"
    assert int(match["port"]) in [p["port"] for p in services[match["host"]]["spec"]["ports"]]
    assert match["user"] in redis_acl_users(), f"Redis defines no ACL user {match['user']!r}"


def test_every_ray_container_has_serves_data_path_settings():
    from specpool.services.serve_config import SERVE_ENV

    for container in _ray_containers(ray_service()):
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert {name: env.get(name) for name in SERVE_ENV} == SERVE_ENV, container["name"]


# -- core manifests: selectors and ports ------------------------------------------------------------
def pod_templates() -> list[tuple[str, dict]]:
    """(owner, pod template) for every workload in k8s/."""
    out = []
    for doc in documents("Deployment"):
        out.append((f"Deployment/{doc['metadata']['name']}", doc["spec"]["template"]))
    for doc in documents("RayService"):
        cluster = doc["spec"]["rayClusterConfig"]
        out.append((f"RayService/{doc['metadata']['name']}:head", cluster["headGroupSpec"]["template"]))
        for group in cluster["workerGroupSpecs"]:
            out.append((f"RayService/{doc['metadata']['name']}:{group['groupName']}", group["template"]))
    return out


def selects(selector: dict, labels: dict) -> bool:
    """Whether a Service selector picks pods with the template's ``labels`` (plus KubeRay's own)."""
    for key, value in selector.items():
        if key in labels:
            if labels[key] != value:
                return False
        elif key in KUBERAY_POD_LABELS:
            if KUBERAY_POD_LABELS[key] not in (None, value):
                return False
        else:
            return False
    return any(key in labels for key in selector)  # at least one label of ours, not KubeRay's alone


def test_deployments_are_complete_and_select_their_pods():
    for doc in documents("Deployment"):
        name = doc["metadata"]["name"]
        assert doc["apiVersion"] == "apps/v1", name
        match_labels = doc["spec"]["selector"]["matchLabels"]
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert match_labels and all(labels.get(k) == v for k, v in match_labels.items()), name
        for container in doc["spec"]["template"]["spec"]["containers"]:
            assert container.get("name") and container.get("image"), name
            assert container.get("readinessProbe"), f"{name}/{container['name']} has no readiness probe"
            limits = container.get("resources", {}).get("limits", {})
            assert {"cpu", "memory"} <= set(limits), f"{name}/{container['name']} has no resource limits"


def _container_port(template: dict, target_port) -> int | None:
    for container in template["spec"]["containers"]:
        for port in container.get("ports", []):
            if target_port in (port.get("name"), port["containerPort"]):
                return port["containerPort"]
    return None


def test_services_select_pods_and_their_ports_exist():
    for doc in documents("Service"):
        name = doc["metadata"]["name"]
        assert doc["apiVersion"] == "v1", name
        selector = doc["spec"].get("selector")
        assert selector, f"Service {name} has no selector"
        matched = [(owner, t) for owner, t in pod_templates() if selects(selector, t["metadata"].get("labels", {}))]
        assert matched, f"Service {name} selects no pods in k8s/: {selector}"
        assert doc["spec"]["ports"], name
        for port in doc["spec"]["ports"]:
            assert isinstance(port["port"], int), name
            target = port.get("targetPort", port["port"])
            for owner, template in matched:
                assert _container_port(template, target) is not None, f"Service {name}: {owner} has no port {target!r}"


def test_selector_matching_can_fail():
    labels = {"app.kubernetes.io/name": "specpool", "app.kubernetes.io/component": "ray-head"}
    assert selects({"app.kubernetes.io/component": "ray-head", "ray.io/serve": "true"}, labels)
    assert not selects({"app.kubernetes.io/component": "ray-haed"}, labels)
    assert not selects({"ray.io/serve": "true"}, labels)  # KubeRay labels alone: any RayService
    assert not selects({"app.kubernetes.io/name": "specpool", "other": "x"}, labels)


def _tls_front(head: dict) -> tuple[dict, argparse.Namespace]:
    from specpool.services.tls_front import build_parser

    fronts = [c for c in head["spec"]["containers"] if "specpool.services.tls_front" in " ".join(c.get("command", []))]
    assert len(fronts) == 1, "the Ray head needs one tls-front sidecar"
    (front,) = fronts
    return front, build_parser().parse_args(front["args"])


def test_grpc_service_targets_the_tls_front_and_the_front_the_serve_grpc_proxy():
    """Public gRPC = TLS: specpool-grpc -> the head's tls-front sidecar -> Serve's proxy on loopback."""
    services = [s for s in documents("Service") if any(p.get("name") == "grpc" for p in s["spec"]["ports"])]
    assert [s["metadata"]["name"] for s in services] == ["specpool-grpc"]
    (service,) = services
    head = ray_service()["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    assert selects(service["spec"]["selector"], head["metadata"]["labels"]), "specpool-grpc does not select the Ray head"
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    front, args = _tls_front(head)
    target = _container_port({"spec": {"containers": [front]}}, port["targetPort"])
    assert target is not None, f"specpool-grpc's targetPort {port['targetPort']!r} is not a port of the tls-front sidecar"
    assert args.listen.rsplit(":", 1) == ["0.0.0.0", str(target)]
    assert args.upstream == f"127.0.0.1:{serve_config()['grpc_options']['port']}"
    assert _container_port(head, "grpc") == serve_config()["grpc_options"]["port"]  # the proxy the front forwards to
    # The certificate and key are the mounted kubernetes.io/tls Secret's files.
    volumes = {v["name"]: v for v in head["spec"].get("volumes", [])}
    mounts = {m["mountPath"]: m for m in front.get("volumeMounts", [])}
    for path, key in ((args.cert, "tls.crt"), (args.key, "tls.key")):
        folder, _, name = path.rpartition("/")
        assert name == key and folder in mounts, f"{path} is not {key} of a mounted volume"
        volume = volumes[mounts[folder]["name"]]
        assert volume["secret"]["secretName"] == TLS_SECRET, volume
    # ... and no worker pod (whose proxy we did not publish) is selected.
    for owner, template in pod_templates():
        if owner.endswith(":head"):
            continue
        assert not selects(service["spec"]["selector"], template["metadata"].get("labels", {})), owner


# -- the application builders exist -----------------------------------------------------------------
def test_import_paths_are_collected():
    assert import_paths() == [
        "specpool.services.serve_app:build_drafter_app",
        "specpool.services.serve_app:build_router_app",
        "specpool.services.serve_app:build_target_app",
    ]


@pytest.mark.parametrize("path", import_paths())
def test_import_paths_resolve(path: str):
    builder = _resolve(path)
    assert callable(builder), f"{path} is not callable"
    assert f"{builder.__module__}:{builder.__name__}" == path  # the function itself, not a re-export


# --- the image the manifests run ----------------------------------------------------------------


def _rayservice() -> dict:
    return next(doc for path in manifest_files() for doc in yaml.load_all(path.read_text(), Loader=_Loader)
                if doc and doc.get("kind") == "RayService")


def test_dockerfile_ray_version_matches_the_rayservice():
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    image = re.search(r"^ARG RAY_IMAGE=rayproject/ray:(\d+\.\d+\.\d+)", dockerfile, re.M)
    assert image, "Dockerfile must build FROM a pinned rayproject/ray image"
    assert image.group(1) == str(_rayservice()["spec"]["rayClusterConfig"]["rayVersion"])


def test_dockerfile_installs_every_package_and_converts_the_target():
    import tomllib

    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    packages = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = set(re.findall(r"^COPY\s+(?:--\S+\s+)*(\S+)\s", dockerfile, re.M))
    for pattern in packages:
        assert pattern.rstrip("*") in copied, f"package {pattern} is not copied into the image"
    assert "pip install ." in dockerfile and "specpool models fetch" in dockerfile
    assert "SPECPOOL_HOME=/home/ray/.cache/specpool" in dockerfile
    # The pods read the converted target from the same folder.
    assert "/home/ray/.cache/specpool" in (K8S / "rayservice.yaml").read_text()


# --- metrics scraping and the HTTP API ----------------------------------------------------------
# The labels KubeRay puts on each kind of Ray pod (besides the template's): ray.io/node-type.
NODE_TYPE = {"head": "head"}  # owner suffix -> node type; every worker group is "worker"


def _ray_pod_templates() -> list[tuple[str, dict, dict]]:
    """(owner, pod template, rayStartParams) of every Ray node group."""
    out = []
    for doc in documents("RayService"):
        cluster = doc["spec"]["rayClusterConfig"]
        name = doc["metadata"]["name"]
        out.append((f"RayService/{name}:head", cluster["headGroupSpec"]["template"], cluster["headGroupSpec"].get("rayStartParams", {})))
        for group in cluster["workerGroupSpecs"]:
            out.append((f"RayService/{name}:{group['groupName']}", group["template"], group.get("rayStartParams", {})))
    return out


def _pod_labels(owner: str, template: dict) -> dict:
    """The labels a pod of ``template`` carries: the template's, plus KubeRay's node type for Ray pods."""
    labels = dict(template["metadata"].get("labels", {}))
    if owner.startswith("RayService/"):
        labels["ray.io/node-type"] = NODE_TYPE.get(owner.rsplit(":", 1)[1], "worker")
    return labels


def label_selector_matches(selector: dict, labels: dict) -> bool:
    """Kubernetes LabelSelector semantics (matchLabels AND every matchExpression)."""
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not ok:
            return False
    return bool(selector.get("matchLabels") or selector.get("matchExpressions"))  # {} would select every pod


def test_label_selector_matching_can_fail():
    selector = {"matchLabels": {"app.kubernetes.io/name": "specpool"},
                "matchExpressions": [{"key": "ray.io/node-type", "operator": "In", "values": ["head", "worker"]}]}
    assert label_selector_matches(selector, {"app.kubernetes.io/name": "specpool", "ray.io/node-type": "worker"})
    assert not label_selector_matches(selector, {"app.kubernetes.io/name": "specpool"})  # Redis: no node type
    assert not label_selector_matches(selector, {"app.kubernetes.io/name": "other", "ray.io/node-type": "head"})
    assert not label_selector_matches({}, {"app.kubernetes.io/name": "specpool"})


def _metrics_port(template: dict) -> int | None:
    ports = [p for c in template["spec"]["containers"] for p in c.get("ports", []) if p.get("name") == "metrics"]
    return ports[0]["containerPort"] if len(ports) == 1 else None


def test_every_ray_pod_names_its_metrics_port_and_has_scrape_annotations():
    """Ray's metrics agent serves the ray_specpool_* series on every node at metrics-export-port."""
    templates = _ray_pod_templates()
    assert len(templates) == 3, [owner for owner, _, _ in templates]
    for owner, template, start_params in templates:
        port = _metrics_port(template)
        assert port is not None, f"{owner}: no single container port named 'metrics'"
        assert int(start_params.get("metrics-export-port", 8080)) == port, f"{owner}: metrics-export-port != container port {port}"
        annotations = template["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", owner
        assert annotations.get("prometheus.io/port") == str(port), owner
        assert annotations.get("prometheus.io/path") == "/metrics", owner


def test_pod_monitor_scrapes_every_ray_pod_and_nothing_else():
    (monitor,) = documents("PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]
    ray_owners = {owner for owner, _, _ in _ray_pod_templates()}
    for owner, template in pod_templates():
        picked = label_selector_matches(selector, _pod_labels(owner, template))
        assert picked == (owner in ray_owners), f"PodMonitor {'selects' if picked else 'misses'} {owner}"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint.get("path", "/metrics") == "/metrics"
    for owner, template, _ in _ray_pod_templates():
        assert _container_port(template, endpoint["port"]) == _metrics_port(template), f"{owner}: no port {endpoint['port']!r}"


def test_http_service_targets_the_serve_http_port():
    (service,) = [s for s in documents("Service") if s["metadata"]["name"] == "specpool-http"]
    head = ray_service()["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    assert selects(service["spec"]["selector"], head["metadata"]["labels"]), "specpool-http does not select the Ray head"
    (port,) = service["spec"]["ports"]
    assert port["port"] == 8000
    options = serve_config()["http_options"]
    assert options["host"] == "0.0.0.0", "Serve's HTTP proxy must listen beyond the pod's loopback"
    target = _container_port(head, port["targetPort"])
    assert target == options["port"] == 8000, f"specpool-http -> head port {target}, Serve's HTTP proxy on {options['port']}"
    for owner, template in pod_templates():
        if not owner.endswith(":head"):
            assert not selects(service["spec"]["selector"], template["metadata"].get("labels", {})), owner


# --- secrets -------------------------------------------------------------------------------------
EXAMPLES = K8S / "examples"


def example_documents() -> list[dict]:
    return [doc for path in sorted(EXAMPLES.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def _secret_uses() -> list[tuple[str, str, str | None]]:
    """(where, Secret name, key or None for a whole-Secret volume) for every reference in k8s/."""
    uses = []
    for owner, template in pod_templates():
        for container in template["spec"]["containers"]:
            for entry in container.get("env", []):
                ref = _secret_ref(entry)
                if ref:
                    uses.append((f"{owner}/{container['name']}:{entry['name']}", *ref))
        for volume in template["spec"].get("volumes", []):
            if "secret" in volume:
                uses.append((f"{owner}:volume {volume['name']}", volume["secret"]["secretName"], None))
    return uses


def test_every_secret_used_is_described_in_the_examples():
    """The Secrets the pods need exist, with those keys, in k8s/examples (secrets.yaml for those
    made by hand, the cert-manager Certificate for the TLS one); nothing in k8s/ holds a secret."""
    assert not [d for d in documents() if d["kind"] == "Secret"], "Secrets belong in k8s/examples, not in manifests applied as they are"
    examples = {d["metadata"]["name"]: d for d in example_documents() if d["kind"] == "Secret"}
    certificates = {d["spec"]["secretName"] for d in example_documents() if d["kind"] == "Certificate"}
    uses = _secret_uses()
    assert {name for _, name, _ in uses} == set(examples) | certificates, uses
    for where, name, key in uses:
        if name in certificates:
            assert name == TLS_SECRET and key is None, where
        elif key is not None:
            assert key in examples[name]["stringData"], f"{where}: Secret {name} has no key {key!r} in k8s/examples/secrets.yaml"


def test_the_example_api_keys_load_and_the_router_reads_them_from_the_environment():
    from specpool.services.auth import ENV_KEYS, load_api_keys

    (secret,) = [d for d in example_documents() if d["metadata"]["name"] == "specpool-api-keys"]
    keys = load_api_keys(None, {ENV_KEYS: secret["stringData"]["keys.yaml"]})
    assert keys.enabled and keys.tenants == {"acme"}
    for container in _ray_containers(ray_service()):  # where router replicas (and the app builder) run
        assert _secret_ref(_env(container)[ENV_KEYS]) == ("specpool-api-keys", "keys.yaml"), container["name"]
    # Not api_keys_file: it is checked when the config is parsed, wherever that is (CI, a laptop).
    assert "api_keys_file" not in applications()["router"]["args"]


# --- the serve config still parses as specpool parses it --------------------------------------
def test_the_shipped_serve_config_is_a_valid_plan_with_feedback_and_the_store():
    from specpool.core.defaults import DEFAULT_DRAFTER
    from specpool.services.serve_config import DrafterArgs, RouterArgs, plan_from_config

    plan = plan_from_config(serve_config(), "k8s/rayservice.yaml")
    router = RouterArgs.parse(plan.router.args)
    assert router.feedback is True, "the shipped config must send feedback to the learner"
    assert router.redis_url_env == "REDIS_URL"
    from specpool.cli.learning import default_learned
    from specpool.services.engine import default_policy, default_pool

    target = applications()["target"]["args"]["model"]
    drafters = {app.args["name"]: DrafterArgs.parse(app.args) for app in plan.apps if app.import_path.endswith(":build_drafter_app")}
    # The pool `specpool serve` deploys on one machine, with its default policy.
    assert list(drafters) == default_pool(target) and router.policy == default_policy(False, target)
    learned = set(default_learned(target))  # what the learner (k8s/learner.yaml: no --drafters) trains
    assert DEFAULT_DRAFTER == "lookup:eagle-alt-int8:general" and DEFAULT_DRAFTER in learned
    for name, args in drafters.items():
        expected = MODEL_STORE if name in learned else None  # only what learns reads versions (others would warn)
        assert args.model_store == expected, f"drafter {name}: model_store {args.model_store!r}"
    assert {name for name, args in drafters.items() if args.model_store} == set(drafters) - {"ngram"}


# --- the learning loop ---------------------------------------------------------------------------
MODEL_STORE = "/mnt/specpool/model-store"


def learner() -> dict:
    (deployment,) = [d for d in documents("Deployment") if d["metadata"]["name"] == "specpool-learner"]
    return deployment


def _learner_container() -> dict:
    (container,) = learner()["spec"]["template"]["spec"]["containers"]
    return container


def learner_args() -> argparse.Namespace:
    """The learner's command line as Kubernetes expands it, parsed by specpool's own parser."""
    from specpool.cli.main import build_parser

    container = _learner_container()
    env = _expanded_env(container)
    argv = [_expand(a, env) for a in container["command"] + container["args"]]
    assert argv[0] == "specpool", argv
    args = build_parser().parse_args(argv[1:])
    assert args.command == "learner", argv
    return args


def _claim(template: dict, volume_name: str) -> str | None:
    for volume in template["spec"].get("volumes", []):
        if volume["name"] == volume_name and "persistentVolumeClaim" in volume:
            return volume["persistentVolumeClaim"]["claimName"]
    return None


def _store_mounts(template: dict) -> list[tuple[dict, str]]:
    """(mount, claim) of every PVC volume mounted in the template's first container."""
    out = []
    for mount in template["spec"]["containers"][0].get("volumeMounts", []):
        claim = _claim(template, mount["name"])
        if claim:
            out.append((mount, claim))
    return out


def test_the_learner_reads_the_routers_stream_and_publishes_where_the_drafters_look():
    from specpool.services.serve_config import RouterArgs

    args = learner_args()
    router = RouterArgs.parse(applications()["router"]["args"])
    assert args.stream == router.feedback_stream
    assert args.redis == _expanded_env(_learner_container())["REDIS_URL"] == "redis://specpool:<REDIS_PASSWORD>@specpool-redis:6379/0"
    assert args.learn_store == MODEL_STORE
    assert args.target == applications()["target"]["args"]["model"]
    assert args.drafters is None, "the learner trains its default (specpool.cli.learning.default_learned): what is served"
    assert args.consumer and "$(" not in args.consumer, "a fixed consumer name: a restarted learner takes back its own pending records"
    assert args.no_progress, "no progress bar in a pod's log"


def test_the_model_store_is_one_readwritemany_claim_mounted_by_the_learner_and_every_worker_group():
    (claim,) = documents("PersistentVolumeClaim")
    name = claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "drafter replicas on many nodes and the learner share it"
    template = learner()["spec"]["template"]
    (mounts,) = [_store_mounts(template)]
    assert [(m["mountPath"], c, m.get("readOnly", False)) for m, c in mounts] == [(MODEL_STORE, name, False)]
    cluster = ray_service()["spec"]["rayClusterConfig"]
    # Any worker group may run drafter replicas (a drafter moved to the GPU group, say): all mount it,
    # read-only (only the learner writes versions).
    for group in cluster["workerGroupSpecs"]:
        found = [(m["mountPath"], c, m.get("readOnly", False)) for m, c in _store_mounts(group["template"])]
        assert found == [(MODEL_STORE, name, True)], f"{group['groupName']}: {found}"
        (volume,) = [v for v in group["template"]["spec"]["volumes"] if v["name"] == _store_mounts(group["template"])[0][0]["name"]]
        assert volume["persistentVolumeClaim"].get("readOnly") is True, group["groupName"]


def test_the_learner_is_one_supervised_replica_with_its_own_cpu_share():
    deployment = learner()
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate", "two learners would publish over each other"
    container = _learner_container()
    probe = container["livenessProbe"]
    assert probe["exec"]["command"] and probe["failureThreshold"] >= 2 and probe["initialDelaySeconds"] >= 60
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert limits["cpu"] == requests["cpu"], "a guaranteed CPU share: training never borrows the replicas' CPUs"
    env = {name: e.get("value") for name, e in _env(container).items()}
    assert env["OMP_NUM_THREADS"] == str(int(float(limits["cpu"]))), "torch's threads = the CPU limit"
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60, "time for the final commit"


def _liveness_script() -> str:
    command = _learner_container()["livenessProbe"]["exec"]["command"]
    assert command[:2] == ["python", "-c"], command
    return command[2]


def _probe(env: dict[str, str]) -> int:
    """The probe's exit status, running its script in this process (a python start per probe would
    take seconds on a loaded machine) with the container's plain env values plus ``env``."""
    container = _learner_container()
    base = {name: e["value"] for name, e in _env(container).items() if "value" in e and "$(" not in e["value"]}
    saved = dict(os.environ)
    os.environ.update({**base, **env})
    try:
        exec(compile(_liveness_script(), "livenessProbe", "exec"), {"__name__": "__main__"})
        return 0
    except SystemExit as exc:
        return 0 if exc.code is None else exc.code
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _local_redis():
    redis = pytest.importorskip("redis")
    client = redis.Redis(host="127.0.0.1", port=6379, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    return client


def test_the_learner_liveness_probe_on_a_real_redis():
    """Stuck = a record has waited longer than LEARNER_MAX_IDLE_MS and the learner took none for as
    long; idle with nothing to do, or Redis unreachable, is alive. Against the real stream layout."""
    from specpool.learning.feedback_redis import RedisFeedbackStream

    client = _local_redis()
    stream = f"test-k8s-probe-{uuid.uuid4().hex[:8]}"
    url = "redis://127.0.0.1:6379/0"
    most_s = 1.0
    env = {"REDIS_URL": url, "FEEDBACK_STREAM": stream, "LEARNER_GROUP": "learners",
           "LEARNER_CONSUMER": "specpool-learner", "LEARNER_MAX_IDLE_MS": str(int(most_s * 1000))}
    assert _probe(env) == 0  # no stream at all yet
    feedback = RedisFeedbackStream(url, stream=stream, group="learners")
    try:
        assert feedback.read("specpool-learner", 10) == []
        for n in range(3):
            feedback.emit(b'{"tenant":"acme","n":%d}' % n, tenant="acme")
        assert feedback.dropped == 0
        assert _probe(env) == 0  # records wait, but not for long yet
        time.sleep(most_s + 0.1)
        assert _probe(env) == 1  # they waited too long and the learner never took one: stuck
        assert len(feedback.read("specpool-learner", 1)) == 1
        assert _probe(env) == 0  # it is taking them (a backlog, not a stuck learner)
        assert _probe({**env, "LEARNER_CONSUMER": "someone-else"}) == 1
        time.sleep(most_s + 0.1)
        assert _probe(env) == 1  # two still wait, and it took none for too long
        assert len(feedback.read("specpool-learner", 10)) == 2
        time.sleep(0.1)
        assert _probe({**env, "LEARNER_MAX_IDLE_MS": "50"}) == 0  # all taken: idle is fine
        with socket.socket() as s:  # a port where nothing listens
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        assert _probe({**env, "REDIS_URL": f"redis://127.0.0.1:{closed}/0"}) == 0
    finally:
        feedback.close()
        keys = list(client.scan_iter(match=f"{stream}*"))
        if keys:
            client.delete(*keys)


# --- Redis access ------------------------------------------------------------------------------
def redis_deployment() -> dict:
    (deployment,) = [d for d in documents("Deployment") if d["metadata"]["name"] == "specpool-redis"]
    return deployment


def _redis_script() -> str:
    (container,) = redis_deployment()["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["sh", "-c"], container["command"]
    return container["args"][0]


def redis_acl_users() -> dict[str, str]:
    """ACL user -> its rule line, from the config Redis is started with."""
    return {line.split()[1]: line for line in _redis_script().splitlines() if line.strip().startswith("user ")}


def test_redis_needs_passwords_from_the_secret():
    (container,) = redis_deployment()["spec"]["template"]["spec"]["containers"]
    env = _env(container)
    assert _secret_ref(env["REDIS_ADMIN_PASSWORD"]) == ("specpool-redis", "admin-password")
    assert _secret_ref(env["REDIS_PASSWORD"]) == ("specpool-redis", "password")
    assert "requirepass $REDIS_ADMIN_PASSWORD" in _redis_script()
    (user,) = redis_acl_users().values()
    namespace = applications()["router"]["args"].get("redis_namespace", "specpool")
    assert f"~{namespace}:*" in user.split() and "-@dangerous" in user.split() and "-@admin" in user.split(), user
    assert "REDIS_PASSWORD" not in " ".join(container["command"]), "passwords stay off the command line"


@pytest.fixture(scope="module")
def manifest_redis(tmp_path_factory):
    """A redis-server started by the manifest's own start script (its config, users and rules),
    on a free port of this machine, with throwaway passwords."""
    if shutil.which("redis-server") is None or shutil.which("sh") is None:
        pytest.skip("no redis-server")
    folder = tmp_path_factory.mktemp("redis-run")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = _redis_script().replace("/run/redis", str(folder))
    script = script.replace("exec redis-server " + str(folder) + "/redis.conf",
                            f"exec redis-server {folder}/redis.conf --port {port} --bind 127.0.0.1")
    assert f"--port {port}" in script
    passwords = {"REDIS_ADMIN_PASSWORD": uuid.uuid4().hex, "REDIS_PASSWORD": uuid.uuid4().hex}
    process = subprocess.Popen(["sh", "-c", script], env={**os.environ, **passwords}, stderr=subprocess.PIPE)
    import redis

    admin = redis.Redis(host="127.0.0.1", port=port, password=passwords["REDIS_ADMIN_PASSWORD"], socket_timeout=2)
    for _ in range(100):
        try:
            admin.ping()
            break
        except redis.RedisError:
            if process.poll() is not None:
                pytest.fail(f"redis-server did not start: {process.stderr.read().decode()[-500:]}")
            time.sleep(0.05)
    yield {"port": port, **passwords, "url": _expand(REDIS_URL.sub(
        lambda m: f"redis://{m['user']}:$(REDIS_PASSWORD)@127.0.0.1:{port}/0", _env(redis_clients()[0][1])["REDIS_URL"]["value"]),
        passwords)}
    process.terminate()
    process.wait(10)


def test_the_example_passwords_are_refused():
    if shutil.which("sh") is None:
        pytest.skip("no sh")
    (secret,) = [d for d in example_documents() if d["metadata"]["name"] == "specpool-redis"]
    env = {"REDIS_ADMIN_PASSWORD": secret["stringData"]["admin-password"], "REDIS_PASSWORD": secret["stringData"]["password"]}
    result = subprocess.run(["sh", "-c", _redis_script()], env={**os.environ, **env}, capture_output=True, text=True, timeout=10)
    assert result.returncode == 1 and "example passwords" in result.stderr, result


def test_the_acl_user_can_do_what_the_router_and_learner_do_and_nothing_else(manifest_redis):
    import redis

    from specpool.learning.feedback_redis import RedisFeedbackStream
    from specpool.router.session_store import RedisSessionStore, SessionKey
    from specpool.services.serve_config import RouterArgs

    router = RouterArgs.parse(applications()["router"]["args"])
    url = manifest_redis["url"]
    # The router's session state (WATCH/MULTI/EXEC, hashes), under its namespace.
    store = RedisSessionStore(url, namespace=router.redis_namespace)
    key = SessionKey("acme", "s1")
    store.transact(key, lambda state: ({"n": (state or {}).get("n", 0) + 1}, {}))
    state, _ = store.read(key)
    assert state == {"n": 1}
    store.delete(key)
    store.close()
    # Feedback: the router emits, the learner reads as a group member and acknowledges.
    emitter = RedisFeedbackStream(url, stream=router.feedback_stream)
    emitter.emit(b'{"tenant":"acme","x":1}', tenant="acme")
    assert emitter.dropped == 0
    reader = RedisFeedbackStream(url, stream=router.feedback_stream)
    deliveries = []
    for _ in range(20):
        deliveries += reader.read("specpool-learner", 10)
        if deliveries:
            break
        time.sleep(0.1)
    assert [d.payload for d in deliveries] == [b'{"tenant":"acme","x":1}']
    assert reader.ack([d.entry_id for d in deliveries]) == 1
    reader.close()
    emitter.close()
    # Nothing outside the namespace, and no administration.
    client = redis.Redis.from_url(url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.set("other:key", "x")
    for command in (("FLUSHALL",), ("CONFIG", "GET", "requirepass"), ("KEYS", "*"), ("ACL", "LIST"), ("CLIENT", "LIST")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)
    # Without a password nothing at all; the admin password is the default user's.
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=manifest_redis["port"]).get("specpool:x")
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=manifest_redis["port"], username="specpool", password="wrong").ping()


# --- who may connect to what -------------------------------------------------------------------
# Sources of a connection: pods with these labels, or "outside" (a client outside the cluster).
RAY_HEAD = {"app.kubernetes.io/name": "specpool", "app.kubernetes.io/component": "ray-head", "ray.io/node-type": "head", "ray.io/serve": "true"}
RAY_WORKER = {"app.kubernetes.io/name": "specpool", "app.kubernetes.io/component": "ray-worker", "ray.io/node-type": "worker"}
LEARNER = {"app.kubernetes.io/name": "specpool", "app.kubernetes.io/component": "learner"}
REDIS = {"app.kubernetes.io/name": "specpool", "app.kubernetes.io/component": "redis"}
OPERATOR = {"app.kubernetes.io/name": "kuberay-operator"}
OTHER_POD = {"app": "something-else"}
OUTSIDE = None


def _peer_matches(peer: dict, source: dict | None) -> bool:
    """One `from` entry (podSelector / namespaceSelector; no ipBlock here) against a source."""
    assert "ipBlock" not in peer, "the evaluator does not model ipBlock"
    if source is None:  # outside the cluster: only an ipBlock could admit it
        return False
    if "podSelector" in peer and not (peer["podSelector"] == {} or label_selector_matches(peer["podSelector"], source)):
        return False
    # namespaceSelector {}: every namespace; without one, the policy's own (all sources are in it here).
    return peer.get("namespaceSelector", {}) == {} or False


def allowed(target: dict, port: int, source: dict | None, policies: list[dict] | None = None) -> bool:
    """NetworkPolicy ingress semantics: a pod no policy selects takes anything; a selected pod
    takes a connection that some rule of some selecting policy admits (from and ports)."""
    policies = documents("NetworkPolicy") if policies is None else policies
    selecting = [p for p in policies if label_selector_matches(p["spec"]["podSelector"], target)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports is not None and not any(p.get("port") == port for p in ports):
                continue
            peers = rule.get("from")
            if peers is None or any(_peer_matches(peer, source) for peer in peers):
                return True
    return False


@pytest.mark.parametrize("target,port,source,expected", [
    # the public ports of the head: from anywhere
    (RAY_HEAD, 9443, OUTSIDE, True), (RAY_HEAD, 8000, OUTSIDE, True), (RAY_HEAD, 9443, OTHER_POD, True),
    # Serve's plaintext gRPC proxy, GCS, dashboard, Ray Client: Ray pods only (the dashboard also the operator)
    (RAY_HEAD, 9000, OUTSIDE, False), (RAY_HEAD, 9000, OTHER_POD, False), (RAY_HEAD, 9000, RAY_WORKER, True),
    (RAY_HEAD, 6379, OTHER_POD, False), (RAY_HEAD, 6379, RAY_WORKER, True),
    (RAY_HEAD, 8265, OUTSIDE, False), (RAY_HEAD, 8265, OTHER_POD, False), (RAY_HEAD, 8265, OPERATOR, True),
    (RAY_HEAD, 10001, OTHER_POD, False), (RAY_HEAD, 10001, OPERATOR, False),
    # the model deployments' replicas (any port on a worker): only other Ray pods, i.e. the routers
    (RAY_WORKER, 9000, OUTSIDE, False), (RAY_WORKER, 8000, OTHER_POD, False), (RAY_WORKER, 43210, OTHER_POD, False),
    (RAY_WORKER, 43210, LEARNER, False), (RAY_WORKER, 43210, RAY_HEAD, True), (RAY_WORKER, 43210, RAY_WORKER, True),
    # metrics: scraped from inside the cluster
    (RAY_WORKER, 8080, OTHER_POD, True), (RAY_WORKER, 8080, OUTSIDE, False),
    # Redis: the routers and the learner
    (REDIS, 6379, RAY_WORKER, True), (REDIS, 6379, RAY_HEAD, True), (REDIS, 6379, LEARNER, True),
    (REDIS, 6379, OTHER_POD, False), (REDIS, 6379, OUTSIDE, False), (REDIS, 6379, OPERATOR, False),
    # the learner: nobody
    (LEARNER, 8080, RAY_HEAD, False), (LEARNER, 22, OTHER_POD, False),
])
def test_network_policies(target, port, source, expected):
    assert allowed(target, port, source) is expected


def test_every_pod_is_under_a_policy_and_the_evaluator_can_fail():
    policies = documents("NetworkPolicy")
    for owner, template in pod_templates():
        labels = _pod_labels(owner, template)
        assert any(label_selector_matches(p["spec"]["podSelector"], labels) for p in policies), f"{owner} takes any connection"
    # Without the public policy the head's TLS port is closed; without any, Redis is open.
    assert not allowed(RAY_HEAD, 9443, OUTSIDE, [p for p in policies if p["metadata"]["name"] != "specpool-public"])
    assert allowed(REDIS, 6379, OTHER_POD, [p for p in policies if p["metadata"]["name"] != "specpool-redis"])


def test_public_policy_ports_are_the_services_ports():
    """The ports opened to everyone are exactly those the public Services send to."""
    (public,) = [p for p in documents("NetworkPolicy") if p["metadata"]["name"] == "specpool-public"]
    opened = {p["port"] for rule in public["spec"]["ingress"] for p in rule["ports"]}
    head = ray_service()["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    targets = {_container_port(head, p["targetPort"]) for s in documents("Service")
               if s["metadata"]["name"] in ("specpool-grpc", "specpool-http") for p in s["spec"]["ports"]}
    assert opened == targets, (opened, targets)


def test_no_ray_client_port_and_the_dashboard_only_inside_the_cluster():
    head = ray_service()["spec"]["rayClusterConfig"]["headGroupSpec"]
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    # KubeRay's head Service publishes the Ray container's ports: no Ray Client (it runs any code sent).
    assert "client" not in ports and 10001 not in ports.values(), ports
    # The operator reaches the dashboard through the head Service (a ClusterIP); no Service of ours
    # publishes it, and no Service is a NodePort or LoadBalancer.
    for service in documents("Service"):
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP", service["metadata"]["name"]
        assert all(p.get("targetPort") not in ("dashboard", ports.get("dashboard")) for p in service["spec"]["ports"])
