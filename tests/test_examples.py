"""The scheduler examples under ``examples/``: shell syntax (``bash -n``), YAML that parses and
has the structure a scheduler needs, and the Hydra overrides they pass to the launcher, composed
and validated against ``conf/`` so that the examples cannot drift from the configuration.

Pure: no etcd, no scheduler, no process but ``bash -n``.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from elastic.config import Config, validate
from launcher.compose import compose

from .conftest import REPO

EXAMPLES = REPO / "examples"
SBATCH = EXAMPLES / "slurm" / "train.sbatch"
K8S = EXAMPLES / "kubernetes"

SCRIPTS = sorted(
    p for p in EXAMPLES.rglob("*") if p.suffix in {".sh", ".sbatch", ".bash"} and p.is_file()
)
YAMLS = sorted(p for p in EXAMPLES.rglob("*") if p.suffix in {".yaml", ".yml"} and p.is_file())

# Sample values for the shell variables in train.sbatch's overrides (as in an allocation).
SLURM_VALUES = {
    "job_id": "resnet50-123456",
    "run_dir": "/shared/elastic/runs/resnet50-123456",
    "endpoints": "10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379",
    "SLURM_JOB_NUM_NODES": "8",
    "min_nodes": "4",
    "shared": "/shared/elastic",
    "data_root": "/data/imagenet",
}
# What Kubernetes puts in the env entries of train-job.yaml that come from the pod.
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
K8S_FIELDS = {"status.podIP": "10.8.0.5", COMPLETION_INDEX: "3", "metadata.name": "etcd-1"}


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_every_scheduler_has_an_example_and_a_readme() -> None:
    assert SBATCH in SCRIPTS
    assert {p.name for p in YAMLS if p.parent == K8S} >= {"etcd.yaml", "train-job.yaml"}
    for folder in (EXAMPLES / "slurm", K8S):
        assert (folder / "README.md").is_file(), folder


@pytest.mark.parametrize("script", SCRIPTS, ids=rel)
def test_shell_syntax(script: Path) -> None:
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("path", YAMLS, ids=rel)
def test_yaml_parses(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{rel(path)} holds no document"
    if path.is_relative_to(K8S):
        for doc in docs:
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), doc
            assert doc["metadata"].get("name"), doc


def composed_and_validated(
    overrides: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Config:
    """``overrides`` composed into the launch's config, and validated as the launcher does.

    The data root is replaced by an empty ImageFolder under ``tmp_path`` (the examples name the
    cluster's). ``validate`` asks torchvision whether the model exists; a stand-in that knows the
    examples' model keeps this test from importing torch (test_config checks the real list).
    """
    cfg = compose(overrides)
    for split in (cfg.data.train_dir, cfg.data.val_dir):
        if split:
            (tmp_path / split).mkdir(parents=True, exist_ok=True)
    models = types.SimpleNamespace(list_models=lambda module=None: ["resnet18", "resnet50"])
    monkeypatch.setitem(sys.modules, "torchvision", types.SimpleNamespace(models=models))
    validate(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, root=str(tmp_path))))
    return cfg


# --- Slurm ----------------------------------------------------------------------------------

SHELL_VAR = re.compile(r"\$\{(\w+)(?::-[^}]*)?\}|\$(\w+)")


def sbatch_overrides() -> list[str]:
    """The words of train.sbatch's ``overrides=( ... )`` with SLURM_VALUES for the variables.

    ``'${oc.env:...}'`` is single-quoted there and left to Hydra; ``"$@"`` (the overrides given
    to sbatch) is dropped.
    """
    text = SBATCH.read_text()
    found = re.search(r"^overrides=\($(.*?)^\)$", text, re.M | re.S)
    assert found, "train.sbatch: no overrides=( ... ) list"
    body = found.group(1).replace('"$@"', "")

    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in SLURM_VALUES, f"train.sbatch uses ${name}: add a sample to SLURM_VALUES"
        return SLURM_VALUES[name]

    return shlex.split(SHELL_VAR.sub(value, body), comments=True)


def test_sbatch_runs_one_launcher_per_node_with_its_overrides() -> None:
    text = SBATCH.read_text()
    assert "#SBATCH --ntasks-per-node=1" in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text
    srun = re.search(r"^srun --nodes=.*?(?<!\\)$", text, re.M | re.S)
    assert srun, "train.sbatch: no srun of the launchers"
    assert "--ntasks-per-node=1" in srun.group(0)
    assert srun.group(0).rstrip().endswith('-m launcher "${overrides[@]}"')


def test_sbatch_overrides_compose(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMD_NODENAME", "gpu017")
    cfg = composed_and_validated(sbatch_overrides(), tmp_path, monkeypatch)
    c = cfg.cluster
    assert (cfg.job_id, c.mode, c.node_id) == ("resnet50-123456", "bare_metal", "gpu017")
    assert c.etcd_endpoints == SLURM_VALUES["endpoints"].split(",")
    assert (c.nodes, c.min_nodes) == (8, 4)
    assert cfg.checkpoint.url == "file:///shared/elastic/ckpt/resnet50-123456"
    assert cfg.run_dir.startswith(SLURM_VALUES["shared"])
    assert (cfg.model.name, cfg.data.synthetic) == ("resnet50", False)


def test_a_typo_in_the_sbatch_overrides_would_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: a misspelt key does not compose."""
    monkeypatch.setenv("SLURMD_NODENAME", "gpu017")
    overrides = [o.replace("cluster.min_nodes", "cluster.min_node") for o in sbatch_overrides()]
    with pytest.raises(ValueError, match="min_node"):
        compose(overrides)


# --- Kubernetes -----------------------------------------------------------------------------


def k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for path in YAMLS:
        if path.is_relative_to(K8S):
            for doc in yaml.safe_load_all(path.read_text()):
                if doc:
                    key = (doc["kind"], doc["metadata"]["name"])
                    assert key not in objects, f"{key} defined twice"
                    objects[key] = doc
    return objects


def only(objects: dict[tuple[str, str], dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [doc for (k, _), doc in objects.items() if k == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container(pod_spec: dict[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    key = "initContainers" if init else "containers"
    return next(c for c in pod_spec[key] if c["name"] == name)


def env_values(c: dict[str, Any]) -> dict[str, str]:
    """A container's environment as Kubernetes fills it in, with K8S_FIELDS for the pod's."""
    values = {}
    for e in c.get("env", []):
        if "value" in e:
            values[e["name"]] = str(e["value"])
        else:
            field = e["valueFrom"]["fieldRef"]["fieldPath"]
            assert field in K8S_FIELDS, f"{e['name']} from {field}: add a sample to K8S_FIELDS"
            values[e["name"]] = K8S_FIELDS[field]
    return values


def launcher_overrides(c: dict[str, Any]) -> list[str]:
    """The container's args with each $(VAR) filled in from its env, as Kubernetes does (an
    undefined one would reach the launcher as the literal text)."""
    env = env_values(c)

    def value(m: re.Match[str]) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) in args is not in the container's env"
        return env[m.group(1)]

    return [re.sub(r"\$\((\w+)\)", value, str(a)) for a in c["args"]]


def test_etcd_statefulset_behind_a_headless_service() -> None:
    objects = k8s_objects()
    sts = only(objects, "StatefulSet")
    svc = objects[("Service", sts["spec"]["serviceName"])]["spec"]
    assert svc["clusterIP"] == "None" and svc.get("publishNotReadyAddresses") is True
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["selector"].items() <= labels.items()
    ports = {p["name"]: p["port"] for p in svc["ports"]}
    etcd = sts["spec"]["template"]["spec"]["containers"][0]
    flags = dict(a.removeprefix("--").split("=", 1) for a in etcd["command"][1:])
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    members = [f"{name}-{i}" for i in range(sts["spec"]["replicas"])]
    assert flags["initial-cluster"] == ",".join(
        f"{m}=http://{m}.{service}:{ports['peer']}" for m in members
    )
    assert flags["name"] == "$(POD_NAME)" and "POD_NAME" in env_values(etcd)
    assert flags["advertise-client-urls"] == f"http://$(POD_NAME).{service}:{ports['client']}"


def test_indexed_job_of_launchers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    objects = k8s_objects()
    job = only(objects, "Job")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    if "podFailurePolicy" in spec:
        assert pod["restartPolicy"] == "Never"
    launcher = container(pod, "launcher")
    assert launcher["command"][-2:] == ["-m", "launcher"]

    cfg = composed_and_validated(launcher_overrides(launcher), tmp_path, monkeypatch)
    c = cfg.cluster
    assert c.mode == "bare_metal" and cfg.job_id
    assert c.nodes == spec["completions"] and c.min_nodes <= c.nodes
    assert c.node_id.endswith(K8S_FIELDS[COMPLETION_INDEX])  # one id per index
    assert c.host == K8S_FIELDS["status.podIP"]

    # The endpoints are the members of the etcd StatefulSet, at its Service's client port.
    sts = only(objects, "StatefulSet")
    svc = objects[("Service", sts["spec"]["serviceName"])]["spec"]
    client = next(p["port"] for p in svc["ports"] if p["name"] == "client")
    members = [
        f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:{client}"
        for i in range(sts["spec"]["replicas"])
    ]
    assert c.etcd_endpoints == members
    for init in pod.get("initContainers", []):
        if "ETCD_ENDPOINTS" in env_values(init):
            assert env_values(init)["ETCD_ENDPOINTS"].split(",") == members

    # GPUs: requested, and the number the health check expects.
    resources = launcher["resources"]
    gpus = resources["limits"]["nvidia.com/gpu"]
    assert resources["requests"].get("nvidia.com/gpu", gpus) == gpus
    assert cfg.health.expected_gpus in (0, gpus)

    # The checkpoints, the run directory and the data are on volumes the pod mounts; the
    # checkpoints and the run directory on a claim every pod can write.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in launcher["volumeMounts"]}

    def volume_of(path: str) -> dict[str, Any]:
        under = [m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")]
        assert under, f"{path} is on no volume of the launcher container"
        return volumes[mounts[max(under, key=len)]]

    assert cfg.checkpoint.url.startswith("file://")
    for path in (cfg.checkpoint.url.removeprefix("file://"), cfg.run_dir, cfg.data.root):
        claim = volume_of(path)["persistentVolumeClaim"]["claimName"]
        pvc = objects[("PersistentVolumeClaim", claim)]
        if path != cfg.data.root:
            assert "ReadWriteMany" in pvc["spec"]["accessModes"], claim
    assert volume_of("/dev/shm")["emptyDir"]["medium"] == "Memory"


def test_a_typo_in_the_job_args_would_fail() -> None:
    launcher = container(only(k8s_objects(), "Job")["spec"]["template"]["spec"], "launcher")
    overrides = [
        o.replace("cluster.node_id", "cluster.nodeid") for o in launcher_overrides(launcher)
    ]
    with pytest.raises(ValueError, match="nodeid"):
        compose(overrides)
