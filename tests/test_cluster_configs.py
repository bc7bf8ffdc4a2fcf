"""cluster/: the launcher YAMLs pass Ray's own validation; the KubeRay manifests have
what KubeRay needs (autoscaling on, a CPU group from zero, a GPU group, the job)."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from raypipe.cli.classify import RunConfig

CLUSTER = Path(__file__).resolve().parents[1] / "cluster"


def _load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


@pytest.mark.parametrize("name", ["aws.yaml", "local-autoscaling.yaml"])
def test_launcher_yaml_passes_rays_schema(name):
    validate_config(_load(name))  # raises jsonschema.ValidationError on any bad field


def test_aws_yaml_survives_rays_preparation_with_cpu_and_gpu_node_types():
    config = prepare_config(_load("aws.yaml"))  # merges the AWS defaults, as `ray up` does
    validate_config(config)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"]["CPU"] == 0, "no actor or Train worker belongs on the head"
    cpu = types["cpu-preprocess"]
    assert cpu["min_workers"] == 0 and cpu["max_workers"] >= 8
    assert "GPU" not in cpu["resources"] and cpu["labels"]["raypipe-role"] == "preprocess"
    gpu = types["gpu-train"]
    assert gpu["resources"]["GPU"] >= 1 and gpu["labels"]["raypipe-role"] == "train"
    # one logical CPU per GPU: the Train workers (cpus_per_worker 1) leave none for actors
    assert gpu["resources"]["CPU"] == gpu["resources"]["GPU"]


AWS_LOCKDOWN = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_USE_TLS", "RAY_TLS_SERVER_CERT",
                "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")  # fmt: skip


def _exported(command: str) -> dict[str, str]:
    """The NAME=VALUE pairs of a command's ``export`` (up to its ``&&``), or of the
    ``printf 'export %s\\n' ...`` that writes them to a file."""
    words = shlex.split(command)
    starts = [i for i, word in enumerate(words) if word.split(" ")[0] == "export"]
    if not starts:
        return {}
    pairs = {}
    for word in words[starts[0] + 1 :]:
        if "=" not in word:
            break
        name, value = word.split("=", 1)
        pairs[name] = value
    return pairs


def _aws_lockdown_problems(config: dict) -> list[str]:
    """What cluster/aws.yaml's lock-down lacks: token mode and Ray's TLS exported before
    each ``ray start``, the same in the SSH sessions' env file, the token and CA shipped
    by file_mounts, the dashboard on the head's loopback."""
    problems = []
    envs = {}
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in config[key] if "ray start" in c]
        env = envs[key] = _exported(start[: start.rindex("ray start")])
        if env.get("RAY_AUTH_MODE") != "token":
            problems.append(f"{key}: RAY_AUTH_MODE is not token")
        if env.get("RAY_USE_TLS") != "1":
            problems.append(f"{key}: RAY_USE_TLS is not 1")
        problems += [f"{key}: {var} unset" for var in AWS_LOCKDOWN if not env.get(var)]
    if envs["head_start_ray_commands"] != envs["worker_start_ray_commands"]:
        problems.append("the head and the workers start with different settings")
    ssh = [_exported(c) for c in config["setup_commands"] if "ray-tls/env" in c]
    if ssh != [envs["head_start_ray_commands"]]:
        problems.append("~/ray-tls/env does not set what the start commands set")
    shipped = {remote.replace("~", "$HOME", 1) for remote in config["file_mounts"]}
    token = envs["head_start_ray_commands"].get("RAY_AUTH_TOKEN_PATH")
    if token not in shipped or "$HOME/ray-secrets/ca.crt" not in shipped:
        problems.append("file_mounts do not ship the token and the CA")
    (head,) = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    if re.findall(r"--dashboard-host[= ](\S+)", head) != ["127.0.0.1"]:
        problems.append("the dashboard is not on 127.0.0.1 only")
    return problems


def _without(config: dict, key: str, old: str, new: str = "") -> dict:
    changed = copy.deepcopy(config)
    changed[key] = [c.replace(old, new) for c in changed[key]]
    assert changed[key] != config[key], (key, old)
    return changed


def test_aws_yaml_is_locked_down():
    config = _load("aws.yaml")
    assert _aws_lockdown_problems(config) == []
    assert _aws_lockdown_problems(prepare_config(_load("aws.yaml"))) == []
    head, worker = "head_start_ray_commands", "worker_start_ray_commands"
    broken = [  # each setting taken away is caught
        _without(config, head, "RAY_AUTH_MODE=token"),
        _without(config, worker, "RAY_AUTH_MODE=token", "RAY_AUTH_MODE=disabled"),
        *(_without(config, k, "RAY_USE_TLS=1") for k in (head, worker)),
        *(_without(config, k, f"{var}=$HOME/ray-tls/") for k in (head, worker)
          for var in ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")),
        _without(config, worker, "RAY_AUTH_TOKEN_PATH=$HOME/ray-secrets/auth_token"),
        _without(config, head, "--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0"),
        _without(config, head, " --dashboard-host=127.0.0.1"),
        _without(config, "setup_commands", "RAY_USE_TLS=1 "),
        dict(config, file_mounts={}),
    ]  # fmt: skip
    for changed in broken:
        assert _aws_lockdown_problems(changed), changed


def _shell(command: str, home: Path) -> subprocess.CompletedProcess:
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    return subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True)


@pytest.mark.skipif(not shutil.which("openssl"), reason="needs openssl")
def test_aws_yaml_commands_make_the_certificate_and_refuse_a_missing_file(tmp_path):
    """setup_commands and the start commands as bash runs them on a node (the launcher's
    file_mounts played by a copy, ``ray start`` by an echo): the node's certificate is
    signed by the CA for 127.0.0.1 and every address of the node, a worker drops the CA's
    key, and a missing file stops setup or start in one line naming it."""
    if _shell("hostname -I", tmp_path).returncode:
        pytest.skip("needs hostname -I")
    config = _load("aws.yaml")
    home, mine = tmp_path / "node", tmp_path / "mine"
    (mine / ".raypipe/aws").mkdir(parents=True)
    (home / ".bashrc").parent.mkdir()
    (home / ".bashrc").write_text("")
    made = _shell("set -e\n" + DOCS_CA_AND_TOKEN, mine)  # the commands docs/security.md gives
    assert made.returncode == 0, made.stderr

    def sync():  # what the launcher's file_mounts do before setup_commands run
        for remote, local in config["file_mounts"].items():
            dest = home / remote.removeprefix("~/")
            dest.parent.mkdir(exist_ok=True)
            shutil.copy(mine / local.removeprefix("~/"), dest)

    sync()
    installs = ("pip install", "command -v pip")  # the node's packages: not run here
    setup = [c for c in config["setup_commands"] if not c.startswith(installs)]
    for command in setup * 2 + config["worker_setup_commands"]:  # twice: re-runs are fine
        done = _shell(command, home)
        assert done.returncode == 0, (command, done.stderr)

    tls = home / "ray-tls"
    verify = _shell(f"openssl verify -CAfile {tls}/ca.crt {tls}/tls.crt", home)
    assert verify.returncode == 0 and verify.stdout.strip().endswith("OK"), verify
    text = _shell(f"openssl x509 -noout -ext subjectAltName -in {tls}/tls.crt", home).stdout
    addresses = _shell("hostname -I", home).stdout.split() + ["127.0.0.1"]
    for address in addresses:
        assert f"IP Address:{address}" in text or address.count(":") > 1, (address, text)
    assert not (home / "ray-secrets/ca.key").exists(), "a worker keeps the CA's key"
    assert (home / ".bashrc").read_text().count("ray-tls/env") == 2  # one line: test, source
    assert "export RAY_USE_TLS=1" in (tls / "env").read_text()

    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in config[key] if "ray start" in c]
        start = start[: start.rindex("ray start")] + "echo started"
        assert _shell(start, home).stdout == "started\n"
        for name in ("ray-tls/tls.key", "ray-secrets/auth_token"):
            (home / name).rename(home / (name + ".away"))
            done = _shell(start, home)
            (home / (name + ".away")).rename(home / name)
            assert done.returncode == 1 and "started" not in done.stdout
            assert done.stderr.count("\n") == 1 and str(home / name) in done.stderr, done
    sync()
    (home / "ray-secrets/auth_token").write_text("")
    done = _shell(setup[0], home)
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert str(home / "ray-secrets/auth_token") in done.stderr, done.stderr


def test_aws_yaml_with_a_local_file_missing_stops_ray_up_naming_it(tmp_path, monkeypatch):
    """``ray up`` reads every file_mounts file to hash it before it syncs anything to the
    head; a missing CA key stops it there, naming the file."""
    from ray.autoscaler._private.util import hash_runtime_conf

    config = _load("aws.yaml")
    monkeypatch.setenv("HOME", str(tmp_path))
    made = _shell("set -e\n" + DOCS_CA_AND_TOKEN, tmp_path)
    assert made.returncode == 0, made.stderr
    hash_runtime_conf(config["file_mounts"], None, config, generate_file_mounts_contents_hash=True)
    (tmp_path / ".raypipe/aws/ca.key").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / ".raypipe/aws/ca.key"))):
        hash_runtime_conf(
            config["file_mounts"], None, config, generate_file_mounts_contents_hash=True
        )


def _docs_block(marker: str) -> str:
    """The bash block of docs/security.md holding ``marker``."""
    text = (CLUSTER.parent / "docs" / "security.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


DOCS_CA_AND_TOKEN = _docs_block("~/.raypipe/aws")


def test_local_autoscaling_yaml_is_the_fake_multinode_provider():
    config = _load("local-autoscaling.yaml")
    assert config["provider"]["type"] == "fake_multinode"
    assert config["idle_timeout_minutes"] <= 0.5
    workers = [
        t for name, t in config["available_node_types"].items() if name != "ray.head.default"
    ]
    assert len(workers) == 1 and workers[0]["min_workers"] == 0 and workers[0]["max_workers"] >= 2


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((CLUSTER / "kuberay" / name).read_text()) if d]


def test_raycluster_autoscales_a_cpu_group_from_zero_and_has_a_gpu_group():
    (cluster,) = _docs("raycluster.yaml")
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert head["template"]["spec"]["containers"][0]["image"].startswith("rayproject/ray:")
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    cpu, gpu = groups["cpu-preprocess"], groups["gpu-train"]
    assert cpu["minReplicas"] == 0 and cpu["maxReplicas"] >= 8
    assert cpu["minReplicas"] <= cpu["replicas"] <= cpu["maxReplicas"]
    assert "raypipe-role=preprocess" in cpu["rayStartParams"]["labels"]
    for group in (cpu, gpu):
        assert group["template"]["spec"]["containers"], group["groupName"]
        assert "rayStartParams" in group
    gpu_limits = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    gpus = int(gpu_limits["nvidia.com/gpu"])
    assert gpus >= 1 and "nvidia.com/gpu" not in str(cpu["template"])
    assert int(gpu["rayStartParams"]["num-cpus"]) == gpus  # no CPU left for actors


def test_rayjob_runs_train_ddp_on_the_raycluster_with_a_valid_run_config():
    (job,) = _docs("rayjob.yaml")
    (cluster,) = _docs("raycluster.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert spec["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    # a separate submitter Job (the only mode that takes an existing cluster), admitted to
    # the job API by networkpolicy.yaml under the Job's name, which is the RayJob's
    assert spec["submissionMode"] == "K8sJobMode"
    (policy,) = _docs("networkpolicy.yaml")
    peers = policy["spec"]["ingress"][1]["from"]
    names = [p["podSelector"]["matchLabels"].get("batch.kubernetes.io/job-name") for p in peers]
    assert job["metadata"]["name"] in names
    words = spec["entrypoint"].split()
    assert words[:2] == ["python", "jobs/train_ddp.py"]
    assert (CLUSTER.parent / words[1]).is_file()
    run = RunConfig.from_yaml(CLUSTER.parent / words[2])  # the run config it names is valid
    assert run.trainer.use_gpu and run.trainer.max_failures >= 1
    assert run.trainer.cpus_per_worker == 1
    assert "working_dir" in yaml.safe_load(spec["runtimeEnvYAML"])


def test_s3_run_config_is_valid_and_holds_no_credentials():
    run = RunConfig.from_yaml(CLUSTER / "s3-run.yaml")
    for section in (run.data, run.eval):
        assert section.source.startswith("s3://") and section.storage_options
        assert not {"access_key", "secret_key", "key", "secret"} & set(section.storage_options)
    assert run.data.label_member == "cls" and run.data.max_skipped == 0.01


def _kuberay_schema(kind: str) -> dict:
    """KubeRay's CRD schema (vendored from its v1.7.0 CRDs), strict as ``kubectl
    --validate=strict``: an object with listed properties takes no others."""
    import gzip
    import json

    path = Path(__file__).parent / "schemas" / f"kuberay-v1.7.0-{kind}.json.gz"
    schema = json.loads(gzip.decompress(path.read_bytes()))["openAPIV3Schema"]

    def strict(node):
        if isinstance(node, dict):
            if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node.setdefault("additionalProperties", False)
            for value in node.values():
                strict(value)
        elif isinstance(node, list):
            for value in node:
                strict(value)

    strict(schema)
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


@pytest.mark.parametrize("name,kind", [("raycluster.yaml", "rayclusters"),
                                       ("rayjob.yaml", "rayjobs")])  # fmt: skip
def test_kuberay_manifests_validate_against_kuberays_crds(name, kind):
    from openapi_schema_validator import OAS30Validator

    schema = _kuberay_schema(kind)
    (doc,) = _docs(name)
    OAS30Validator(schema).validate(doc)
    bad = dict(doc, spec=dict(doc["spec"], entrypiont="typo"))  # the check can fail
    with pytest.raises(Exception, match="entrypiont"):
        OAS30Validator(schema).validate(bad)


def test_raycluster_is_locked_down():
    (cluster,) = _docs("raycluster.yaml")
    spec = cluster["spec"]
    assert spec["authOptions"]["mode"] == "token"
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        pod = group["template"]["spec"]
        env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
        assert env["RAY_USE_TLS"] == "1"
        (init,) = pod["initContainers"]
        for var in ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT"):
            name = Path(env[var]).name
            assert name in init["args"][0], (var, "not made by the init container")
        secrets = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
        assert secrets == ["raypipe-ray-ca"]


def test_networkpolicy_admits_only_the_clusters_pods_and_validates():
    import kubernetes_validate

    (policy,) = _docs("networkpolicy.yaml")
    (cluster,) = _docs("raycluster.yaml")
    kubernetes_validate.validate(policy, "1.37.0", strict=True)
    name = cluster["metadata"]["name"]
    assert policy["spec"]["podSelector"]["matchLabels"] == {"ray.io/cluster": name}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    whole, dashboard = policy["spec"]["ingress"]
    assert whole == {"from": [{"podSelector": {"matchLabels": {"ray.io/cluster": name}}}]}
    assert dashboard["ports"] == [{"protocol": "TCP", "port": 8265}]
    assert all(peer.get("podSelector", {}).get("matchLabels") for peer in dashboard["from"])
    bad = dict(policy, spec=dict(policy["spec"], podSelectr={}))
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.37.0", strict=True)


def _autoscaler_tls_problems(cluster: dict) -> list[str]:
    """What the KubeRay autoscaler lacks of the head container's TLS: it is a container of
    the head pod that talks to the GCS, so it needs every TLS variable and the volume
    holding the certificates (read-only), or it never scales."""
    spec = cluster["spec"]
    (head,) = spec["headGroupSpec"]["template"]["spec"]["containers"]
    options = spec.get("autoscalerOptions") or {}
    env = {e["name"]: e.get("value") for e in options.get("env", [])}
    problems = [f"autoscaler: {e['name']} unset" for e in head["env"]
                if "TLS" in e["name"] and env.get(e["name"]) != e.get("value")]  # fmt: skip
    files = [e["value"] for e in head["env"] if e["name"].startswith("RAY_TLS_")]
    for mount in head["volumeMounts"]:
        if any(f.startswith(mount["mountPath"] + "/") for f in files):
            wanted = {"name": mount["name"], "mountPath": mount["mountPath"], "readOnly": True}
            if wanted not in options.get("volumeMounts", []):
                problems.append(f"autoscaler: {mount['name']} not mounted read-only")
    return problems


IMAGE_USER = (1000, 100)  # rayproject/ray's user: ray, uid 1000, in group users (100)


def _secret_readable(pod: dict, volume: str) -> bool:
    """Whether the image's user reads Secret ``volume``'s files in ``pod``, by kubelet's
    rule (kubernetes/kubernetes#57923): root's, ``defaultMode``; with the pod's
    ``fsGroup``, of that group, and group read added (a Secret volume is read-only)."""
    (secret,) = [v["secret"] for v in pod["volumes"] if v["name"] == volume]
    mode, fs_group = secret.get("defaultMode", 0o644), pod.get("securityContext", {}).get("fsGroup")
    uid, gid = IMAGE_USER
    if fs_group is not None:
        mode |= 0o440
    if uid == 0:
        return True
    if (fs_group if fs_group is not None else 0) in {gid, fs_group}:
        return bool(mode & 0o040)
    return bool(mode & 0o004)


def test_every_pods_init_container_can_read_the_ca_it_signs_with():
    """The CA Secret was mounted 0400 (root's) into an init container that runs as the
    image's ray user: openssl could not read ca.key, and no pod started (a simulation:
    there is no Kubernetes here)."""
    (cluster,) = _docs("raycluster.yaml")
    spec = cluster["spec"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        (init,) = pod["initContainers"]
        assert "runAsUser" not in init.get("securityContext", {})  # the image's user
        assert {"name": "ray-ca", "mountPath": "/etc/ray/ca", "readOnly": True} in init[
            "volumeMounts"
        ]
        assert _secret_readable(pod, "ray-ca"), group.get("groupName", "head")
        assert not any(m["name"] == "ray-ca" for m in pod["containers"][0]["volumeMounts"])
        assert not _secret_readable(
            {k: v for k, v in pod.items() if k != "securityContext"}, "ray-ca"
        )


def test_raycluster_autoscaler_gets_the_heads_tls():
    (cluster,) = _docs("raycluster.yaml")
    assert _autoscaler_tls_problems(cluster) == []
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"RAY_USE_TLS", "RAY_TLS_CA_CERT"} <= {e["name"] for e in head["env"]}

    def changed(**options):  # new lists: the YAML anchor shares the head's env list
        return dict(cluster, spec=dict(cluster["spec"], autoscalerOptions=options))

    options = cluster["spec"]["autoscalerOptions"]
    broken = [  # each thing taken away is caught
        changed(**{k: v for k, v in options.items() if k != "env"}),
        changed(**dict(options, env=[e for e in options["env"] if e["name"] != "RAY_TLS_CA_CERT"])),
        changed(**dict(options, env=[{"name": "RAY_USE_TLS", "value": "0"}, *options["env"][1:]])),
        changed(**{k: v for k, v in options.items() if k != "volumeMounts"}),
        changed(**dict(options, volumeMounts=[dict(options["volumeMounts"][0], readOnly=False)])),
    ]  # fmt: skip
    for cluster_changed in broken:
        assert _autoscaler_tls_problems(cluster_changed), cluster_changed["spec"]


def _dependencies() -> list:
    """pyproject.toml's [project] dependencies, as packaging's Requirements."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement

    project = tomllib.loads((CLUSTER.parent / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]]


def _install_lists() -> dict[str, list[str]]:
    """What each cluster config installs for a job: aws.yaml's pip command, the RayJob's
    runtime_env pip list."""
    (pip,) = [c for c in _load("aws.yaml")["setup_commands"] if c.startswith("pip install")]
    (job,) = _docs("rayjob.yaml")
    return {
        "aws.yaml": [w for w in shlex.split(pip)[2:] if not w.startswith("-")],
        "kuberay/rayjob.yaml": yaml.safe_load(job["spec"]["runtimeEnvYAML"])["pip"],
    }


def _missing(dependencies: list, install: list[str], provided=frozenset()) -> list[str]:
    """The dependencies ``install`` lacks or gives another spec or extras (torch may have
    its own spec: the build is the cluster's choice); ``provided`` names those the image has."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    given = {canonicalize_name(r.name): r for r in map(Requirement, install)}
    problems = []
    for dep in dependencies:
        name = canonicalize_name(dep.name)
        got = given.get(name)
        if name in provided:
            continue
        if got is None:
            problems.append(f"{dep} is not installed")
        elif name != "torch" and (got.specifier, got.extras) != (dep.specifier, dep.extras):
            problems.append(f"{got} is not {dep}")
    return problems


@pytest.mark.parametrize("name", ["aws.yaml", "kuberay/rayjob.yaml"])
def test_cluster_configs_install_every_dependency(name):
    """A job imports every [project] dependency (crc32c: the decoded cache, unconditionally),
    so each cluster config installs them all; on KubeRay ray is the image's own."""
    dependencies, install = _dependencies(), _install_lists()[name]
    provided = set()
    if name.startswith("kuberay/"):
        (ray,) = [d for d in dependencies if d.name == "ray"]
        (pin,) = [s.version for s in ray.specifier if s.operator == "=="]
        (cluster,) = _docs("raycluster.yaml")
        pods = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
        images = [c["image"] for g in pods for c in g["template"]["spec"]["containers"]]
        assert all(i.startswith(f"rayproject/ray:{pin}-") for i in images), images
        provided = {"ray"}
    assert _missing(dependencies, install, provided) == []
    for dep in dependencies:  # each one taken away, or given another spec, is caught
        if dep.name not in provided:
            rest = [r for r in install if not r.startswith(dep.name)]
            assert _missing(dependencies, rest, provided) == [f"{dep} is not installed"]
    assert _missing(dependencies, [*install, "crc32c>=1"], provided)


def test_aws_nodes_boot_an_image_ray_2_60_installs_on():
    """``latest_dlami`` is Ray's fixed old Deep Learning AMI (Ubuntu 18.04, CUDA 11.2):
    Ray 2.60 needs Python 3.10. The nodes take AWS's current DLAMI by its public parameter."""
    from ray.autoscaler._private.aws.config import DEFAULT_AMI_NAME

    assert "18.04" in DEFAULT_AMI_NAME  # what latest_dlami means in this Ray
    for name, node in _load("aws.yaml")["available_node_types"].items():
        image = node["node_config"]["ImageId"]
        assert image.startswith("resolve:ssm:/aws/service/deeplearning/ami/x86_64/"), name
        assert "ubuntu-22.04" in image, name  # Python 3.10, pip installs as the user
    setup = _load("aws.yaml")["setup_commands"]
    assert "python3-pip" in setup[0] and setup[1].startswith("pip install")


def test_every_claim_the_raycluster_mounts_is_made_and_shared_between_nodes():
    (cluster,) = _docs("raycluster.yaml")
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    claims = {v["persistentVolumeClaim"]["claimName"] for g in groups
              for v in g["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}  # fmt: skip
    assert claims == {"raypipe-data"}
    made = {d["metadata"]["name"]: d for f in sorted((CLUSTER / "kuberay").glob("*.yaml"))
            for d in _docs(f.name) if d.get("kind") == "PersistentVolumeClaim"}  # fmt: skip
    assert claims <= set(made), f"{claims - set(made)} mounted, never made"
    assert all(made[c]["spec"]["accessModes"] == ["ReadWriteMany"] for c in claims)


def test_every_submit_line_of_a_cluster_config_sends_the_clusters_token():
    """Both clusters ask for a token (401 without one): the lines to copy carry it."""
    for path in sorted(CLUSTER.glob("*.yaml")):
        text = path.read_text()
        for m in re.finditer(r"raypipe submit (?:[^\n]*\\\n)*[^\n]*", text):
            assert "--token-file" in m.group(0), f"{path.name}: {m.group(0)}"


def test_s3_runs_sets_made_as_its_comment_says_pass_the_classifier_jobs_checks(
    ray_session, tmp_path
):  # fmt: skip
    """Both sets `raypipe convert` output of folders with the same classes: the job lists
    them and names the classes (it refused integer-only labels, and a held-out set whose
    class names are not the training set's)."""
    from raypipe.cli.classify import check_classes
    from raypipe.cli.convert import ShardsConfig, convert
    from tests.conftest import make_imagefolder

    run = RunConfig.from_yaml(CLUSTER / "s3-run.yaml")
    assert run.data.format == run.eval.format == "webdataset"
    sets = {}
    for name, seed in (("train", 0), ("val", 1)):
        folder = make_imagefolder(tmp_path / name, {"n01440764": 3, "n01443537": 3}, seed=seed)
        sets[name] = tmp_path / f"{name}-shards"
        convert(ShardsConfig(source=str(folder), out=str(sets[name]), format="webdataset",
                             shards=2))  # fmt: skip
    small = {"storage_options": {}, "batch_size": 2, "actors": (1, 1)}  # 6 images, not S3
    local = RunConfig(
        data=run.data.replace(source=str(sets["train"]), **small),
        eval=run.eval.replace(source=str(sets["val"]), **small),
        trainer=dataclasses.replace(run.trainer, num_workers=1, use_gpu=False),
    )
    assert check_classes(local, "s3-run.yaml") == ("n01440764", "n01443537")
