"""cluster/: the launcher YAMLs pass Ray's own validation; the KubeRay manifests have
what KubeRay needs (autoscaling on, a CPU group from zero, a GPU group, the job)."""

from __future__ import annotations

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
