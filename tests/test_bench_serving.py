"""serving/: the dashboard queries only what the server exports; the proxy keeps SSE intact."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from qpipe.serve.metrics import ServerMetrics

SERVING = Path(__file__).resolve().parents[1] / "serving"
METRIC_NAME = re.compile(r"qpipe:[A-Za-z0-9_:]+")


SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gauge": ("",),
}


def exported_sample_names() -> set[str]:
    """Every series name the server's registry can produce; labelled metrics with no child yet
    (finish reasons before the first request) have no samples, so names come from the types."""
    families = list(ServerMetrics("any-model").registry.collect())
    names = {sample.name for family in families for sample in family.samples}
    names |= {f.name + suffix for f in families for suffix in SUFFIXES.get(f.type, ())}
    return names


def dashboard_queries() -> list[str]:
    dashboard = json.loads((SERVING / "grafana/dashboards/qpipe.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]]
    return exprs


def test_every_dashboard_metric_is_exported() -> None:
    exported = exported_sample_names()
    queried = {name for expr in dashboard_queries() for name in METRIC_NAME.findall(expr)}
    assert queried, "the dashboard queries no qpipe: metric"
    assert queried <= exported, f"not exported by qpipe/serve/metrics.py: {queried - exported}"
    # the panels: TTFT/ITL percentiles, throughput, running/waiting, KV, prefix, preemptions
    for needed in (
        "qpipe:time_to_first_token_seconds_bucket", "qpipe:inter_token_latency_seconds_bucket",
        "qpipe:generation_tokens_total", "qpipe:num_requests_running",
        "qpipe:num_requests_waiting", "qpipe:kv_cache_usage_perc", "qpipe:prefix_cache_hits_total",
        "qpipe:prefix_cache_queries_total", "qpipe:num_preemptions_total",
    ):  # fmt: skip
        assert needed in queried
    percentiles = [e for e in dashboard_queries() if "histogram_quantile(0.99" in e]
    assert len(percentiles) >= 2 and all("_bucket" in e and "by (le)" in e for e in percentiles)


def test_dashboard_uses_the_provisioned_datasource() -> None:
    datasources = yaml.safe_load(
        (SERVING / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"]
    uids = {ds["uid"] for ds in datasources}
    dashboard = json.loads((SERVING / "grafana/dashboards/qpipe.json").read_text())
    used = {p["datasource"]["uid"] for p in dashboard["panels"]}
    used |= {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert used == uids


def test_compose_wires_the_services_together() -> None:
    compose = yaml.safe_load((SERVING / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"qpipe", "prometheus", "grafana", "nginx"} <= set(services)
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (SERVING / source).exists(), f"compose mounts missing {source}"
    assert (SERVING / services["qpipe"]["build"]["dockerfile"].split("/")[-1]).is_file()
    prometheus = yaml.safe_load((SERVING / "prometheus.yml").read_text())
    targets = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["qpipe:8000"] and "8000:8000" in services["qpipe"]["ports"]


def test_nginx_keeps_event_streams_flowing() -> None:
    conf = re.sub(r"#.*", "", (SERVING / "nginx.conf").read_text())
    directives = {
        m.group(1): m.group(2).strip() for m in re.finditer(r"^\s*(\w+)\s+([^;{]*);", conf, re.M)
    }
    assert directives["proxy_buffering"] == "off"
    assert directives["proxy_http_version"] == "1.1"
    assert directives["proxy_set_header"]  # Connection "" for upstream keep-alive
    assert 'proxy_set_header Connection ""' in conf
    assert int(directives["proxy_read_timeout"].rstrip("s")) >= 600
    assert "text/event-stream" not in directives.get("gzip_types", "")
    assert "keepalive" in directives
