"""The Kubernetes manifests in k8s/: KubeRay resources valid against the CRD schemas, the Serve
config valid the way Serve reads it, and the pieces wired to each other (selectors, ports, Redis,
drafters, import paths)."""

from __future__ import annotations

import copy
import functools
import importlib
import re
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
    assert "specpool.v1.specpool_pb2_grpc.add_SpecPoolServicer_to_server" in functions
    for function in functions:
        assert callable(_resolve(function)), function


def test_router_args_and_the_pool():
    apps = applications()
    args = apps["router"]["args"]
    for key in ("redis_url", "policy", "k"):
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
    cluster = service["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
    return [c for t in templates for c in t["spec"]["containers"]]


def test_one_image_everywhere():
    images = {c["image"] for c in _ray_containers(ray_service())}
    assert len(images) == 1, images
    assert re.match(r"^[\w.-]+(/[\w.-]+)+:[\w.-]+$", images.pop()), "an image with an explicit tag"


def test_redis_url_names_the_redis_service():
    url = applications()["router"]["args"]["redis_url"]
    match = re.match(r"^redis://([\w.-]+):(\d+)(/\d+)?$", url)
    assert match, url
    host, port = match.group(1), int(match.group(2))
    services = {s["metadata"]["name"]: s for s in documents("Service")}
    assert host.split(".")[0] in services, f"{host} is not a Service in k8s/"
    assert port in [p["port"] for p in services[host.split(".")[0]]["spec"]["ports"]]
    for container in _ray_containers(ray_service()):
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("REDIS_URL") == url, f"{container['name']}: REDIS_URL {env.get('REDIS_URL')!r} != {url!r}"


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


def test_grpc_service_targets_the_serve_grpc_port():
    services = [s for s in documents("Service") if any(p.get("name") == "grpc" for p in s["spec"]["ports"])]
    assert [s["metadata"]["name"] for s in services] == ["specpool-grpc"]
    (service,) = services
    head = ray_service()["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    assert selects(service["spec"]["selector"], head["metadata"]["labels"]), "specpool-grpc does not select the Ray head"
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    assert _container_port(head, port["targetPort"]) == serve_config()["grpc_options"]["port"]
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
