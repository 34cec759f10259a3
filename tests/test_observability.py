"""deploy/prometheus and deploy/grafana against a running server: a real Prometheus (Debian's
`prometheus` package) scrapes a real `pagefleet serve` on loopback (one Ray-placed group, Redis
for the prefix index) with the shipped scrape configuration and alert rules, while
`pagefleet demo` and a load of long and cancelled requests run. Every PromQL expression of the
Grafana dashboard then returns data through Prometheus' HTTP API, as does every alert's
expression; the alerts whose condition the run makes true are shown pending or firing in
Prometheus (KV cache nearly full, preemptions, the prefix index unreachable once Redis stops,
no live group once the group's process is killed). The rest fire in their promtool unit tests
(tests/test_deploy.py)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.process_tree import descendants
from tests.redis_server import RedisServer, free_port
from tests.serve_process import builtin_model_flags, start_serve

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PROMETHEUS = shutil.which("prometheus")
READY_S = 300  # a local Ray runtime and a group, on a busy 2-core machine
RATE_WINDOW = "1m"  # stands for Grafana's $__rate_interval
# One group of 40 blocks of 16 tokens, and 24 requests at once of 16 + 112 tokens (8 blocks each
# at their end): 192 blocks of demand, in pieces small enough that the running requests keep the
# cache over 90% full for seconds (larger ones leave whole requests' worth of blocks free
# between them), preempting one another as they grow. The queue bound is far above them.
ENGINE = ["--num-blocks", "40", "--max-model-len", "512", "--max-num-seqs", "32", "--max-waiting", "64"]
LONG_REQUESTS = 24
LONG_TOKENS = 112

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="needs Debian's prometheus package (scripts/install.sh --test)"
)


class Prometheus:
    """A `prometheus` process on loopback, on the shipped configuration with the target, the
    rule files' paths and the intervals (1 s) made for a short run."""

    def __init__(self, tmp: Path, target: str) -> None:
        config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(DEPLOY / "prometheus" / f) for f in config["rule_files"]]
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": [target]}]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = tmp / "prometheus.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={tmp / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address={self.url[7:]}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.wait(lambda: self._get("/-/ready") == 200, 60, "Prometheus ready")
        self.wait(lambda: self.query("up == 1"), 60, "a first scrape of the server")

    def _get(self, path: str) -> int | None:
        try:
            return urllib.request.urlopen(self.url + path, timeout=5).status
        except OSError:
            assert self.proc.poll() is None, self.log.read_text()
            return None

    def query(self, expr: str) -> list[dict]:
        """The instant vector of `expr` now (a PromQL error fails the test with its message)."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        try:
            body = json.load(urllib.request.urlopen(url, timeout=10))
        except urllib.error.HTTPError as e:
            pytest.fail(f"{expr}: {e.read().decode()}")
        assert body["status"] == "success", body
        return body["data"]["result"]

    def targets(self) -> list[dict]:
        """The scrape targets' health and last error (for failure messages)."""
        body = json.load(urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10))
        return [{k: t.get(k) for k in ("scrapeUrl", "health", "lastError")} for t in body["data"]["activeTargets"]]

    def alerts_seen(self) -> set[str]:
        """Alerts pending or firing at some moment of the last 10 minutes."""
        return {r["metric"]["alertname"] for r in self.query("max_over_time(ALERTS[10m])")}

    def wait(self, predicate, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while not (got := predicate()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.25)
        return got

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(server process, client, Prometheus, Redis), the server scraped every second."""
    tmp = tmp_path_factory.mktemp("observability")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    with RedisServer() as redis_server:
        metrics_port = free_port()
        flags = [
            "--ray",
            *builtin_model_flags(),
            "--redis",
            redis_server.url,
            "--grace",
            "1",
            "--metrics-port",
            str(metrics_port),
            *ENGINE,
        ]
        proc, client = start_serve(flags, free_port(), tmp / "serve.log", READY_S, env)
        prometheus = None
        try:
            prometheus = Prometheus(tmp, f"127.0.0.1:{metrics_port}")
            yield proc, client, prometheus, redis_server
        finally:
            if prometheus is not None:
                prometheus.close()
            client.close()
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def demo_run(client) -> None:
    """`pagefleet demo` (one document, eight questions as chat), then 24 requests at once
    (the cache fills, requests are preempted) and one the client cancels after two tokens."""
    demo = subprocess.run(
        [sys.executable, "-m", "pagefleet", "demo", "--server", client.target, "--max-tokens", "6"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr

    def long_request(i: int):
        ids = [(37 * i + 11 * k) % 1000 + 1 for k in range(16)]
        return client.generate(token_ids=ids, max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True)

    with ThreadPoolExecutor(LONG_REQUESTS) as pool:
        done = list(pool.map(long_request, range(LONG_REQUESTS)))
    assert all(d.completion_tokens == LONG_TOKENS for d in done)
    stream = client.generate_stream(token_ids=list(range(1, 60)), max_tokens=300)
    for _, _chunk in zip(range(2), stream, strict=False):
        pass
    stream.close()  # cancels the call


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard, its variables filled as Grafana
    fills them for "All"."""
    board = json.loads((DEPLOY / "grafana" / "pagefleet.json").read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", RATE_WINDOW)
            out.append((panel["title"], expr.replace("$model_name", ".*")))
    for var in board["templating"]["list"]:
        if var["type"] == "query":  # label_values(METRIC, LABEL): the metric must have it
            metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", var["definition"]).groups()
            out.append((f"variable {var['name']}", f"group by ({label}) ({metric})"))
    return out


def alert_rules() -> dict[str, str]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules" / "pagefleet.rules.yml").read_text())
    return {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}


def without_bound(expr: str) -> str:
    """An alert's expression without its final comparison: what it compares to the bound."""
    m = re.fullmatch(r"(.*\S)\s*(==|!=|>=|<=|>|<)\s*[0-9.]+\s*", expr, re.DOTALL)
    assert m, expr
    return m.group(1)


def total(prometheus: Prometheus, metric: str) -> float:
    result = prometheus.query(f"sum({metric})")
    return float(result[0]["value"][1]) if result else 0.0


def has_numbers(result: list[dict]) -> bool:
    return any(not math.isnan(float(r["value"][1])) for r in result)


def test_every_dashboard_and_alert_expression_returns_data_after_a_demo_run(stack):
    proc, client, prometheus, _ = stack
    demo_run(client)
    served = client.cluster_status()[0]
    # Prometheus has scraped the run's end: its generated tokens are all there
    prometheus.wait(
        lambda: total(prometheus, "pagefleet:request_success_total") >= 8 + LONG_REQUESTS,
        30,
        f"the run's requests in Prometheus ({prometheus.targets()})",
    )
    time.sleep(2)  # two more scrapes: every rate has its run in its window
    assert served.preemptions > 0  # the run made the cache overflow
    empty = []
    for title, expr in dashboard_queries():
        if not has_numbers(prometheus.query(expr)):
            empty.append(f"{title}: {expr}")
    for name, expr in alert_rules().items():
        if not prometheus.query(without_bound(expr)):
            empty.append(f"alert {name}: {without_bound(expr)}")
    assert not empty, "no data:\n" + "\n".join(empty)
    cancelled = prometheus.query('sum(pagefleet:request_errors_total{code="CANCELLED"})')
    assert float(cancelled[0]["value"][1]) == 1
    fired = {"PagefleetKVCacheNearlyFull"}  # (preemptions: too few in a short run to fire)
    seen = prometheus.wait(lambda: fired <= (s := prometheus.alerts_seen()) and s, 30, str(fired))
    assert "PagefleetNoLiveGroup" not in seen and "PagefleetPrefixIndexDown" not in seen


def test_alerts_fire_when_redis_stops_and_when_the_only_group_dies(stack):
    proc, client, prometheus, redis_server = stack
    quiet = {
        "PagefleetPrefixIndexDown",
        "PagefleetPrefixIndexMirrorLagging",
        "PagefleetNoLiveGroup",
    }
    assert not quiet & prometheus.alerts_seen()  # none of them before their cause
    redis_server.stop()  # the router's index (its mirror of Redis) goes unreachable
    try:
        prometheus.wait(
            lambda: {"PagefleetPrefixIndexDown", "PagefleetPrefixIndexMirrorLagging"} <= prometheus.alerts_seen(),
            30,
            "the prefix index alerts",
        )
        up = prometheus.query("pagefleet:prefix_index_up")
        assert [r["value"][1] for r in up] == ["0"] and up[0]["metric"]["backend"] == "redis"
    finally:
        redis_server.start()
    ranks = [p for p, name in descendants(proc.pid).items() if name.startswith("ray::RankActor")]
    assert len(ranks) == 1, descendants(proc.pid)
    os.kill(ranks[0], signal.SIGKILL)  # the only group dies; its supervisor starts another
    prometheus.wait(lambda: "PagefleetNoLiveGroup" in prometheus.alerts_seen(), 60, "the no-live-group alert")
    dead = prometheus.query(
        "max_over_time(pagefleet:group_alive[1m]) == 0 or min_over_time(pagefleet:group_alive[1m]) == 0"
    )
    assert dead and dead[0]["metric"]["group"] == "group-0"
