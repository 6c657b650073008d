"""Writes k8s/grafana/dashboard-configmap.yaml from specpool-dashboard.json, the one source.

    python k8s/grafana/build_configmap.py          # rewrite the ConfigMap after editing the JSON
    python k8s/grafana/build_configmap.py --check  # exit 1 if the ConfigMap is stale

The ConfigMap carries the JSON text verbatim (a YAML literal block), so Grafana's dashboard sidecar
(label grafana_dashboard: "1") loads exactly the file that was imported or reviewed;
tests/unit/test_dashboard.py fails when the two differ.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "specpool-dashboard.json"
CONFIGMAP = HERE / "dashboard-configmap.yaml"

HEADER = """\
# GENERATED from specpool-dashboard.json by `python k8s/grafana/build_configmap.py`: edit the JSON,
# then rerun it (tests/unit/test_dashboard.py checks the two are equal).
#
# Grafana's dashboard sidecar (kube-prometheus-stack / the Grafana Helm chart with
# sidecar.dashboards.enabled) loads every ConfigMap labelled grafana_dashboard: "1" in the namespaces
# it searches (sidecar.dashboards.searchNamespace): apply this one there, e.g. `-n monitoring`.
"""


def render(dashboard_text: str) -> str:
    json.loads(dashboard_text)  # refuse to ship a file Grafana cannot parse
    body = "".join(f"    {line}\n" if line else "\n" for line in dashboard_text.rstrip("\n").split("\n"))
    return (f"{HEADER}apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: specpool-grafana-dashboard\n"
            f"  labels:\n    grafana_dashboard: \"1\"\n    app.kubernetes.io/name: specpool\n"
            f"    app.kubernetes.io/component: dashboard\n"
            f"data:\n  {DASHBOARD.name}: |\n{body}")


def main(argv: list[str]) -> int:
    wanted = render(DASHBOARD.read_text())
    if argv == ["--check"]:
        if not CONFIGMAP.exists() or CONFIGMAP.read_text() != wanted:
            print(f"{CONFIGMAP} is stale: run python {Path(__file__).relative_to(HERE.parents[1])}", file=sys.stderr)
            return 1
        return 0
    if argv:
        print(f"usage: python {Path(__file__).name} [--check]", file=sys.stderr)
        return 2
    CONFIGMAP.write_text(wanted)
    print(f"wrote {CONFIGMAP}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
