"""deploy/ read as its users' tools read it: every YAML and JSON file parses; every `pagefleet`
command line in the manifests, the compose file, the Dockerfiles and deploy/README.md parses
with the real CLI parser (and a `serve` line gives a valid ServeConfig); the core Kubernetes
objects, and the pod templates inside the KubeRay ones, validate against Kubernetes' schemas
(kubernetes-validate, offline); the ports, names, labels and paths that bind the files to one
another agree; `promtool check config`, `check rules` and `test rules` pass."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pagefleet.cli import build_parser, serve_config
from router.door.server import LIVENESS_SERVICE
from router.launch.config import DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT, DEFAULT_PORT
from worker.config import parse_size

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kuberay"
PROMTOOL = shutil.which("promtool")
KUBERNETES_VERSION = "1.33"


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kind(name: str) -> dict:
    """The one object of that kind among deploy/kuberay's files."""
    (found,) = [d for p in sorted(KUBE.glob("*.yaml")) for d in docs(p) if d["kind"] == name]
    return found


def objects(name: str) -> list[dict]:
    return [d for p in sorted(KUBE.glob("*.yaml")) for d in docs(p) if d["kind"] == name]


def pod_templates() -> dict[str, dict]:
    """The RayCluster's pod templates by group name (the head's is 'head')."""
    spec = kind("RayCluster")["spec"]
    out = {"head": spec["headGroupSpec"]["template"]}
    out |= {w["groupName"]: w["template"] for w in spec["workerGroupSpecs"]}
    return out


def parse(argv: list[str]):
    """`pagefleet ARGV` through the real parser (a bad flag fails the test with argparse's
    message), and a `serve` line through ServeConfig's checks."""
    parser = build_parser()
    parser.exit = lambda status=0, message=None: pytest.fail(f"pagefleet {shlex.join(argv)}: {message}")
    args = parser.parse_args(argv)
    return serve_config(args) if args.command == "serve" else args


def routers() -> list[tuple[dict, dict, object]]:
    """(pod template, router container, its ServeConfig) of every router pod."""
    out = []
    for template in pod_templates().values():
        for c in template["spec"]["containers"]:
            if c.get("command") == ["pagefleet"] and c["args"][0] == "serve":
                out.append((template, c, parse(c["args"])))
    return out


def groups_start():
    """The parsed `pagefleet groups start` of the RayJob."""
    return parse(shlex.split(kind("RayJob")["spec"]["entrypoint"])[1:])


def command_lines() -> list[tuple[str, list[str]]]:
    """(where, argv after `pagefleet`) of every pagefleet command line under deploy/."""
    out = []
    for name, template in pod_templates().items():
        for c in template["spec"]["containers"]:
            if c.get("command", [None])[0] == "pagefleet":
                out.append((f"raycluster {name}/{c['name']}", c["command"][1:] + c.get("args", [])))
    out.append(("RayJob entrypoint", shlex.split(kind("RayJob")["spec"]["entrypoint"])[1:]))
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    for name, service in compose["services"].items():
        if service.get("command", [None])[0] == "pagefleet":
            out.append((f"compose {name}", service["command"][1:]))
    for dockerfile in sorted((DEPLOY / "docker").glob("Dockerfile.*[!e]")):
        (cmd,) = re.findall(r"^CMD (\[.*\])$", dockerfile.read_text(), re.M)
        out.append((dockerfile.name, json.loads(cmd)[1:]))
    readme = (DEPLOY / "README.md").read_text()
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", readme, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["pagefleet"]:
                out.append(("deploy/README.md", words[1:]))
    return out


def test_every_file_parses():
    files = [p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml")]
    assert len(files) >= 10
    for path in files:
        assert docs(path), path
    json.loads((DEPLOY / "grafana" / "pagefleet.json").read_text())


def test_every_pagefleet_command_line_parses_with_the_cli():
    lines = command_lines()
    wheres = {where for where, _ in lines}
    assert {"RayJob entrypoint", "compose pagefleet", "Dockerfile.cpu", "Dockerfile.cuda"} <= wheres
    assert sum(w.startswith("raycluster") for w in wheres) == 2  # the head's and the routers'
    assert sum(w == "deploy/README.md" for w, _ in lines) >= 3
    for _where, argv in lines:
        parse(argv)


def test_a_bad_flag_fails_the_parse():
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments: --tensor-parallel"):
        parse(["serve", "--tensor-parallel", "2"])


def test_kubernetes_objects_and_pod_templates_validate_against_their_schemas():
    core = [d for p in sorted(KUBE.glob("*.yaml")) for d in docs(p) if "." not in d["apiVersion"].split("/")[0]]
    assert {d["kind"] for d in core} == {"Deployment", "Service"}
    templates = [
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": t}
        for name, t in pod_templates().items()
    ]
    for obj in core + templates:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_routers_ports_probes_and_cluster_agree():
    job, cluster = groups_start(), kind("RayCluster")
    found = routers()
    assert len(found) == 2
    for template, container, config in found:
        assert config.cluster.role == "router" and config.cluster.name == job.cluster
        assert config.cluster.redis == job.redis and config.doors.host == config.doors.metrics_host == "0.0.0.0"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {
            "grpc": config.doors.port,
            "http": config.doors.http_port,
            "metrics": config.doors.metrics_port,
        }
        assert (config.doors.port, config.doors.http_port, config.doors.metrics_port) == (
            DEFAULT_PORT,
            DEFAULT_HTTP_PORT,
            DEFAULT_METRICS_PORT,
        )
        ready, live = container["readinessProbe"]["grpc"], container["livenessProbe"]["grpc"]
        assert ready == {"port": config.doors.port}  # the whole server: NOT_SERVING with no live group
        assert live == {"port": config.doors.port, "service": LIVENESS_SERVICE}
        assert template["spec"]["terminationGracePeriodSeconds"] > config.doors.grace_s
        assert template["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
        # a driver beside its pod's Ray node: the same /tmp/ray and /dev/shm
        ray_container = next(c for c in template["spec"]["containers"] if c is not container)
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert {m["mountPath"]: m["name"] for m in ray_container["volumeMounts"]}.items() >= {
            k: mounts[k] for k in ("/tmp/ray", "/dev/shm")
        }.items()
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        key_dir = str(Path(config.security.api_key_file).parent)
        assert "secret" in volumes[mounts[key_dir]]
        # the router reads the groups' model directory (tokenizer, config) where they read it
        model_mount = next(m for m in mounts if job.model.startswith(m + "/"))
        assert "persistentVolumeClaim" in volumes[mounts[model_mount]]
        assert container["image"] == ray_container["image"]
    head_address = found[0][2].cluster.address
    assert head_address == "$(POD_IP):6379"  # the head's own GCS
    assert {"name": "gcs", "containerPort": 6379} in pod_templates()["head"]["spec"]["containers"][0]["ports"]
    assert found[1][2].cluster.address == f"{cluster['metadata']['name']}-head-svc:6379"  # KubeRay's name


def test_redis_url_names_the_redis_service():
    service = next(s for s in objects("Service") if s["metadata"]["name"] == "pagefleet-redis")
    (port,) = service["spec"]["ports"]
    assert groups_start().redis == f"redis://{service['metadata']['name']}:{port['port']}/0"
    deployment = kind("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    container_ports = deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert {"name": port["targetPort"], "containerPort": port["port"]} in container_ports


def test_gpu_pods_are_sized_by_the_tensor_parallel_degree():
    job, spec = groups_start(), kind("RayCluster")["spec"]
    assert job.action == "start" and job.device == "cuda"
    gpu_groups = [w for w in spec["workerGroupSpecs"] if w["groupName"].startswith("gpu-")]
    assert gpu_groups
    for group in gpu_groups:
        pod = group["template"]["spec"]
        (ray,) = pod["containers"]
        resources = ray["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == job.tp
        assert group["groupName"] == f"gpu-tp{job.tp}"
        assert group["replicas"] * resources["limits"]["nvidia.com/gpu"] // job.tp >= job.groups
        mounts = {m["mountPath"]: m["name"] for m in ray["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert any(job.model.startswith(path + "/") for path in mounts)  # the model is there
    head = pod_templates()["head"]["spec"]["containers"][0]  # `groups start` runs on the head
    assert any(job.model.startswith(m["mountPath"] + "/") for m in head["volumeMounts"])
    selector = kind("RayJob")["spec"]["clusterSelector"]
    assert selector == {"ray.io/cluster": kind("RayCluster")["metadata"]["name"]}


def test_services_and_monitors_select_the_router_pods():
    labels = [t["metadata"]["labels"] for t, _, _ in routers()]
    port_names = {p["name"]: p["containerPort"] for _, c, _ in routers() for p in c["ports"]}
    router_services = [s for s in objects("Service") if "redis" not in s["metadata"]["name"]]
    assert {s["metadata"]["name"] for s in router_services} == {"pagefleet-router", "pagefleet-router-metrics"}
    for service in router_services:
        assert all(service["spec"]["selector"].items() <= lab.items() for lab in labels)
        for port in service["spec"]["ports"]:
            assert port_names[port["targetPort"]] == port["port"]
    monitor = kind("PodMonitor")["spec"]
    assert all(monitor["selector"]["matchLabels"].items() <= lab.items() for lab in labels)
    (endpoint,) = monitor["podMetricsEndpoints"]
    assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules" / "pagefleet.rules.yml").read_text())
    assert kind("PrometheusRule")["spec"]["groups"] == rules["groups"]


def test_compose_prometheus_and_grafana_agree():
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())["services"]
    config = parse(compose["pagefleet"]["command"][1:])
    assert config.cluster.redis == "redis://redis:6379/0" and "redis" in compose
    published = {p.split(":")[-1] for p in compose["pagefleet"]["ports"]}
    assert published == {str(config.doors.port), str(config.doors.http_port)}
    assert compose["pagefleet"]["expose"] == [str(config.doors.metrics_port)]
    assert config.security.api_key_file == "/run/secrets/api_keys" and compose["pagefleet"]["secrets"] == ["api_keys"]
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = scrape["scrape_configs"]
    assert job["static_configs"] == [{"targets": [f"pagefleet:{config.doors.metrics_port}"]}]
    assert "../prometheus:/etc/prometheus:ro" in compose["prometheus"]["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in compose["prometheus"]["command"]
    source = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    assert "127.0.0.1:9090:9090" in compose["prometheus"]["ports"]
    boards = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/pagefleet.yml").read_text())
    path = boards["providers"][0]["options"]["path"]
    assert f"../grafana/pagefleet.json:{path}/pagefleet.json:ro" in compose["grafana"]["volumes"]
    assert "../grafana/provisioning:/etc/grafana/provisioning:ro" in compose["grafana"]["volumes"]


def test_dashboard_queries_the_chosen_prometheus():
    board = json.loads((DEPLOY / "grafana" / "pagefleet.json").read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], panel["title"]


def test_images_expose_the_default_ports_and_copy_every_package():
    packages = re.search(r"include = \[([^\]]*)\]", (ROOT / "pyproject.toml").read_text()).group(1)
    wanted = {p.strip(' "*') for p in packages.split(",")}
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (DEPLOY / "docker" / name).read_text()
        (expose,) = re.findall(r"^EXPOSE (.*)$", text, re.M)
        assert set(expose.split()) == {str(DEFAULT_PORT), str(DEFAULT_HTTP_PORT), str(DEFAULT_METRICS_PORT)}
        copied = set(re.findall(r"^COPY (\w+)/ \1/$", text, re.M))
        assert wanted <= copied, (name, wanted - copied)
        assert "bash scripts/install.sh" in text


promtool = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian's prometheus)")


def run_promtool(*args: str) -> str:
    done = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@promtool
def test_promtool_checks_the_scrape_configuration_and_the_rules(tmp_path):
    out = run_promtool("check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    assert "SUCCESS" in out and "7 rules found" in out
    # the PrometheusRule's rules, as the operator hands them to Prometheus
    (tmp_path / "operator.rules.yml").write_text(yaml.safe_dump(kind("PrometheusRule")["spec"]))
    out = run_promtool("check", "rules", str(tmp_path / "operator.rules.yml"))
    assert "SUCCESS: 7 rules found" in out


@promtool
def test_promtool_unit_tests_of_the_alert_rules_pass():
    out = run_promtool("test", "rules", str(DEPLOY / "prometheus" / "tests" / "pagefleet.rules.test.yml"))
    assert "SUCCESS" in out


def test_the_kv_tiers_disk_directory_is_a_volume_sized_for_them():
    """The groups' disk KV tier is written to a volume (not the container's layer) large enough
    for every device's tier, and the GPU pods' memory leaves room for the host tier."""
    job = groups_start()
    assert job.kv_host_bytes and job.kv_disk_bytes and job.kv_disk_dir
    for group in (w for w in kind("RayCluster")["spec"]["workerGroupSpecs"] if w["groupName"].startswith("gpu-")):
        pod = group["template"]["spec"]
        (ray,) = pod["containers"]
        mounts = {m["mountPath"]: m["name"] for m in ray["volumeMounts"]}
        volume = {v["name"]: v for v in pod["volumes"]}[mounts[job.kv_disk_dir]]
        assert parse_size(volume["emptyDir"]["sizeLimit"].replace("Gi", "GiB")) >= job.tp * job.kv_disk_bytes
        for side in ("requests", "limits"):
            memory = parse_size(ray["resources"][side]["memory"].replace("Gi", "GiB"))
            assert memory - job.tp * job.kv_host_bytes >= 128 * 2**30
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    service = compose["services"]["pagefleet"]
    engine = parse(service["command"][1:]).engine.options
    disk_dir = engine["kv_disk_dir"]
    assert engine["kv_host_bytes"] and engine["kv_disk_bytes"] and disk_dir
    (volume,) = [v.split(":")[0] for v in service["volumes"] if v.split(":")[1] == disk_dir]
    assert volume in compose["volumes"]  # a named volume
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):  # the image's user owns it
        text = (DEPLOY / "docker" / name).read_text()
        assert re.search(rf"mkdir -p [^\n]*{disk_dir}", text) and re.search(rf"chown pagefleet [^\n]*{disk_dir}", text)
