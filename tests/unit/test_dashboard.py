"""The Grafana dashboard k8s/grafana/specpool-dashboard.json: every PromQL expression reads only series
the server exports (``ray_specpool_*`` as Ray's metrics agent names them), groups and filters only
by labels those series carry, the JSON has the shape Grafana loads, and the ConfigMap that ships it
is the JSON verbatim.

The expressions are checked by a small PromQL reader (tokens, selectors, aggregation scopes), not by
string matching, so a renamed metric or label on the server side fails here before a panel goes
blank on a cluster.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from specpool.services.metrics import exported_metric_labels, exported_metric_names

REPO_ROOT = Path(__file__).resolve().parents[2]
GRAFANA = REPO_ROOT / "k8s" / "grafana"
DASHBOARD = GRAFANA / "specpool-dashboard.json"
CONFIGMAP = GRAFANA / "dashboard-configmap.yaml"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# PromQL functions and aggregations a panel may call (a misspelt one is an error, not a metric name).
FUNCTIONS = {"rate", "irate", "increase", "delta", "deriv", "histogram_quantile", "clamp_min", "clamp_max",
             "abs", "ceil", "floor", "round", "vector", "scalar", "time", "label_replace", "avg_over_time",
             "max_over_time", "min_over_time", "sum_over_time", "absent"}
AGGREGATIONS = {"sum", "avg", "min", "max", "count", "group", "stddev", "stdvar", "topk", "bottomk", "quantile"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
OPERATOR_WORDS = {"and", "or", "unless", "bool", "offset"}
# Grafana's own variables, resolved before the query reaches Prometheus.
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s"}

TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<range>\[[^\]]*\])
  | (?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][\w:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=(){},])
""", re.X)


@dataclass
class Selector:
    metric: str
    at: int  # token index, to place it inside aggregation scopes
    matchers: list[str] = field(default_factory=list)


@dataclass
class Query:
    selectors: list[Selector]
    groupings: list[tuple[str, list[str], range]]  # (keyword, labels, token scope of the metrics it groups)
    quantile_scopes: list[range]  # histogram_quantile(...) arguments
    variables: set[str]


def tokenize(expr: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(expr):
        match = TOKEN.match(expr, pos)
        if not match:
            raise ValueError(f"cannot read {expr[pos:pos + 20]!r} in {expr!r}")
        if match.lastgroup != "space":
            tokens.append((match.lastgroup, match.group()))
        pos = match.end()
    return tokens


def _closing(tokens, start: int) -> int:
    """Index of the ``)`` matching the ``(`` at ``start``."""
    depth = 0
    for i in range(start, len(tokens)):
        depth += {"(": 1, ")": -1}.get(tokens[i][1], 0) if tokens[i][0] == "op" else 0
        if depth == 0:
            return i
    raise ValueError("unbalanced parentheses")


def _label_list(tokens, start: int) -> tuple[list[str], int]:
    """Labels of ``(a, b)`` at ``start``; returns them and the index after ``)``."""
    if start >= len(tokens) or tokens[start][1] != "(":
        return [], start
    end = _closing(tokens, start)
    labels = [value for kind, value in tokens[start + 1:end] if kind == "ident"]
    if any(value != "," for kind, value in tokens[start + 1:end] if kind != "ident"):
        raise ValueError(f"not a label list: {' '.join(v for _, v in tokens[start:end + 1])}")
    return labels, end + 1


def parse(expr: str) -> Query:
    """The selectors, groupings and histogram_quantile arguments of one PromQL expression."""
    variables = set(re.findall(r"\$\{?(\w+)", expr))
    # Grafana interpolates variables before Prometheus parses; outside strings and ranges only
    # $__rate_interval-style builtins would survive tokenizing, so a stray $x fails below.
    tokens = tokenize(re.sub(r"\[\$\{?\w+\}?\]", "[1m]", expr))
    selectors, groupings, quantiles = [], [], []
    whole = range(0, len(tokens))
    i = 0
    while i < len(tokens):
        kind, value = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else None
        if kind == "op" and value == "{":
            raise ValueError(f"a selector without a metric name in {expr!r}")
        if kind != "ident":
            i += 1
            continue
        if value in AGGREGATIONS and following in ("(", "by", "without"):
            j = i + 1
            labels, keyword = [], None
            if tokens[j][1] in ("by", "without"):
                keyword = tokens[j][1]
                labels, j = _label_list(tokens, j + 1)
            end = _closing(tokens, j)
            if keyword is None and end + 1 < len(tokens) and tokens[end + 1][1] in ("by", "without"):
                keyword = tokens[end + 1][1]
                labels, _ = _label_list(tokens, end + 2)
            if keyword == "by":
                groupings.append(("by", labels, range(j, end + 1)))
            i = j if keyword else i + 1
            continue
        if following == "(" and value not in GROUPING:
            if value not in FUNCTIONS:
                raise ValueError(f"unknown PromQL function {value}() in {expr!r}")
            if value == "histogram_quantile":
                quantiles.append(range(i + 1, _closing(tokens, i + 1) + 1))
            i += 1
            continue
        if value in GROUPING:
            labels, j = _label_list(tokens, i + 1)
            if value in ("on", "ignoring", "group_left", "group_right"):
                groupings.append((value, labels, whole))  # matching labels: both operands carry them
            i = j if j > i + 1 else i + 1
            continue
        if value in OPERATOR_WORDS:
            i += 1
            continue
        selector = Selector(value, i)
        if following == "{":
            end = next(k for k in range(i + 1, len(tokens)) if tokens[k][1] == "}")
            inner = tokens[i + 2:end]
            for k in range(0, len(inner), 4):  # label op "value" [,]
                part = inner[k:k + 4]
                if len(part) < 3 or part[0][0] != "ident" or part[1][1] not in ("=", "!=", "=~", "!~") or part[2][0] != "string":
                    raise ValueError(f"cannot read the matchers of {value} in {expr!r}")
                selector.matchers.append(part[0][1])
            i = end + 1
        else:
            i += 1
        selectors.append(selector)
    return Query(selectors, groupings, quantiles, variables)


def problems(expr: str, names: set[str], labels: dict[str, set[str]], variables: set[str]) -> list[str]:
    """What is wrong with ``expr`` against the exported series ``names`` and their ``labels``."""
    try:
        query = parse(expr)
    except ValueError as error:
        return [str(error)]
    out = []
    if not query.selectors:
        out.append(f"reads no metric: {expr!r}")
    for selector in query.selectors:
        if selector.metric not in names:
            out.append(f"unknown metric {selector.metric} in {expr!r}")
            continue
        for label in selector.matchers:
            if label not in labels[selector.metric]:
                out.append(f"{selector.metric} has no label {label!r} (filtered in {expr!r})")
    for keyword, grouped, scope in query.groupings:
        for selector in (s for s in query.selectors if s.at in scope and s.metric in names):
            for label in grouped:
                if label not in labels[selector.metric]:
                    out.append(f"{keyword} ({label}) but {selector.metric} has no label {label!r} in {expr!r}")
    for scope in query.quantile_scopes:
        inside = [s for s in query.selectors if s.at in scope]
        if not inside or not all(s.metric.endswith("_bucket") for s in inside):
            out.append(f"histogram_quantile over something other than _bucket series in {expr!r}")
        if not any(keyword == "by" and "le" in grouped and set(group_scope) <= set(scope)
                   for keyword, grouped, group_scope in query.groupings):
            out.append(f"histogram_quantile's argument must keep le (sum by (le, ...)) in {expr!r}")
    for variable in sorted(query.variables - variables - GRAFANA_BUILTINS):
        out.append(f"${variable} is not a template variable of the dashboard ({expr!r})")
    return out


# -- fixtures -----------------------------------------------------------------------------------------
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def exported() -> tuple[set[str], dict[str, set[str]]]:
    names = set(exported_metric_names())
    labels = {name: set(label_set) for name, label_set in exported_metric_labels().items()}
    assert names == set(labels), "exported_metric_names() and exported_metric_labels() disagree"
    for name in names:
        if name.endswith("_bucket"):
            labels[name].add("le")  # Prometheus's own bucket label, on every _bucket series
    return names, labels


def graph_panels(dash: dict) -> list[dict]:
    out = []
    for panel in dash["panels"]:
        out.extend(panel.get("panels", []))  # panels of a collapsed row
        if panel["type"] != "row":
            out.append(panel)
    return out


def targets() -> list[pytest.param]:
    return [pytest.param(target["expr"], id=f"{panel['title']}:{target['refId']}")
            for panel in graph_panels(dashboard()) for target in panel["targets"]]


def variable_names(dash: dict) -> set[str]:
    return {variable["name"] for variable in dash["templating"]["list"]}


# -- the queries read what the server exports -----------------------------------------------------------
def test_exported_names_are_ray_prometheus_series():
    names, _ = exported()
    assert names and all(name.startswith("ray_specpool_") for name in names), sorted(names)
    assert all(re.fullmatch(r"[a-z_:][a-z0-9_:]*", name) for name in names)


@pytest.mark.parametrize("expr", targets())
def test_every_panel_query_reads_exported_series_and_labels(expr):
    names, labels = exported()
    assert problems(expr, names, labels, variable_names(dashboard())) == []


def test_template_variable_queries_read_exported_series():
    names, labels = exported()
    dash = dashboard()
    queries = [v for v in dash["templating"]["list"] if v["type"] == "query"]
    assert {v["name"] for v in queries} >= {"endpoint", "tenant"}
    for variable in queries:
        assert variable["datasource"] == DATASOURCE, variable["name"]
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert match, f"{variable['name']}: {query!r} is not label_values(SELECTOR, LABEL)"
        selector, label = match.groups()
        assert problems(selector, names, labels, variable_names(dash)) == [], variable["name"]
        for parsed in parse(selector).selectors:
            assert label in labels[parsed.metric], f"${variable['name']}: {parsed.metric} has no label {label}"


def test_every_exported_family_has_a_panel():
    """A series the server exports but no panel shows is a dashboard gap (or a dead metric)."""
    names, _ = exported()
    family = lambda name: re.sub(r"_(total|bucket|sum|count)$", "", name)  # noqa: E731
    queried = {family(s.metric) for panel in graph_panels(dashboard()) for t in panel["targets"]
               for s in parse(t["expr"]).selectors}
    assert {family(name) for name in names} - queried == set()


# -- the checker can fail ------------------------------------------------------------------------------------
@pytest.mark.parametrize("expr, complaint", [
    ("sum(rate(ray_specpool_roundz_total[5m]))", "unknown metric ray_specpool_roundz_total"),
    ("sum by (drafter) (rate(ray_specpool_rounds[5m]))", "unknown metric ray_specpool_rounds "),  # counter without _total
    ("sum by (drafter) (rate(ray_specpool_requests_total[5m]))", "ray_specpool_requests_total has no label 'drafter'"),
    ("sum(rate(ray_specpool_requests_total[5m])) by (drafter)", "ray_specpool_requests_total has no label 'drafter'"),
    ('sum(rate(ray_specpool_queue_seconds_count{tenant=~"$tenant"}[5m]))', "has no label 'tenant'"),
    ("histogram_quantile(0.9, sum by (endpoint) (rate(ray_specpool_queue_seconds_bucket[5m])))", "must keep le"),
    ("histogram_quantile(0.9, sum by (le) (rate(ray_specpool_queue_seconds_sum[5m])))", "other than _bucket"),
    ("sum(rat(ray_specpool_rounds_total[5m]))", "unknown PromQL function rat()"),
    ('sum(rate(ray_specpool_rounds_total{drafter=~"$model"}[5m]))', "$model is not a template variable"),
    ('sum(rate({__name__="ray_specpool_rounds_total"}[5m]))', "without a metric name"),
])
def test_the_checker_rejects_a_bad_expression(expr, complaint):
    names, labels = exported()
    found = problems(expr, names, labels, variable_names(dashboard()))
    assert any(complaint in problem for problem in found), found


def test_the_checker_accepts_grouping_on_a_label_every_operand_has():
    names, labels = exported()
    expr = ("sum by (drafter) (rate(ray_specpool_rounds_total[5m])) / on() group_left "
            "sum(rate(ray_specpool_rounds_total[5m]))")
    assert problems(expr, names, labels, set()) == []
    assert problems(expr.replace("on()", "on(part)"), names, labels, set())  # rounds has no part


# -- Grafana's shape -------------------------------------------------------------------------------------------
def test_dashboard_shape():
    dash = dashboard()
    assert dash["uid"] and dash["title"]
    assert isinstance(dash["schemaVersion"], int) and 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in dash["panels"]] + [p["id"] for row in dash["panels"] for p in row.get("panels", [])]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids), ids
    for panel in graph_panels(dash):
        title = panel.get("title")
        assert title and panel.get("description"), f"panel {panel['id']} needs a title and a description"
        assert panel["datasource"] == DATASOURCE, title
        refs = [target.get("refId") for target in panel["targets"]]
        assert refs and all(refs) and len(set(refs)) == len(refs), title
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].strip(), title
    titles = [panel["title"] for panel in graph_panels(dash)]
    assert len(set(titles)) == len(titles), titles


def test_panels_sit_on_the_grid_without_overlapping():
    taken = {}
    for panel in dashboard()["panels"]:
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("h", "w", "x", "y")), panel["id"]
        assert grid["w"] >= 1 and grid["h"] >= 1 and 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["id"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, f"panels {taken[(x, y)]} and {panel['id']} overlap at {(x, y)}"
                taken[(x, y)] = panel["id"]


def test_the_readme_describes_every_panel():
    readme = (REPO_ROOT / "k8s" / "README.md").read_text()
    missing = [panel["title"] for panel in graph_panels(dashboard()) if panel["title"] not in readme]
    assert missing == [], f"k8s/README.md does not describe {missing}"


# -- the ConfigMap is the JSON -------------------------------------------------------------------------------------
def _builder():
    spec = importlib.util.spec_from_file_location("build_configmap", GRAFANA / "build_configmap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configmap_carries_the_dashboard_verbatim():
    configmap = yaml.safe_load(CONFIGMAP.read_text())
    assert configmap["kind"] == "ConfigMap" and configmap["apiVersion"] == "v1"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["data"] == {DASHBOARD.name: DASHBOARD.read_text()}, \
        "stale ConfigMap: run python k8s/grafana/build_configmap.py"
    assert CONFIGMAP.read_text() == _builder().render(DASHBOARD.read_text())
    # kubectl apply (client side) keeps the whole object in an annotation of at most 256 KiB.
    assert len(CONFIGMAP.read_bytes()) < 256 * 1024


def test_the_drift_check_can_fail():
    text = DASHBOARD.read_text()
    edited = text.replace('"title": "specpool"', '"title": "specpool (edited)"', 1)
    assert edited != text
    assert yaml.safe_load(_builder().render(edited))["data"][DASHBOARD.name] == edited
    assert _builder().render(edited) != CONFIGMAP.read_text()
