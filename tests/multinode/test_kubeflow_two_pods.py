"""Tier 3 (standalone): the PyTorchJob of docs/multinode.md, its two pods emulated by two network namespaces.

No torchrun: each "pod" runs ``two_node_job.py --environment kubeflow`` (the manifest's ``python train.py``) with the
variables the Kubeflow training operator sets in that pod (``MASTER_ADDR`` = the master's service name, ``MASTER_PORT``
= its ``pytorchjob-port``, ``WORLD_SIZE`` = the replicas, ``RANK`` = the pod's index, the ``PET_*`` torchrun
arguments), computed from the manifest in the docs. The service name resolves to the master host in both
namespaces through a hosts file per namespace (``ip netns exec`` mounts ``/etc/netns/<ns>/hosts`` over
``/etc/hosts``), as the cluster DNS resolves a headless service to its pod.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from _two_hosts import assert_trained_and_agree, job_args, read_results, run_on_hosts
from lightning.fabric.plugins.environments import KubeflowEnvironment, LightningEnvironment
from lightning.pytorch import Trainer

import lightning_pdist  # noqa: F401  (registers the strategy names)
from lightning_pdist.bench.netns import EmulatedNetwork

DOC = Path(__file__).resolve().parents[2] / "docs" / "multinode.md"
AVAILABLE, REASON = EmulatedNetwork.available()
# Whatever makes a process a torchrun worker, a SLURM/LSF/MPI task or a Lightning-launched rank: a pod has none.
LAUNCHER_VARS = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|NODE_RANK|GROUP_RANK|MASTER_ADDR|MASTER_PORT"
                           r"|TORCHELASTIC_.*|PET_.*|SLURM_.*|LSB_.*|OMPI_.*|PMI_.*)$")  # fmt: skip


def documented_job() -> dict:
    """The PyTorchJob manifest of docs/multinode.md."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    jobs = [doc for doc in map(yaml.safe_load, blocks) if doc.get("kind") == "PyTorchJob"]
    assert len(jobs) == 1, f"{DOC} must hold one PyTorchJob manifest, found {len(jobs)}"
    return jobs[0]


def pytorch_container(job: dict, replica_type: str) -> dict:
    containers = job["spec"]["pytorchReplicaSpecs"][replica_type]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "pytorch")


def pod_env(job: dict, replica_type: str, index: int) -> dict[str, str]:
    """What the training operator (kubeflow.org/v1, no ``elasticPolicy``) sets in pod ``index`` of ``replica_type``.

    ``MASTER_ADDR`` is ``<job>-master-0``, ``MASTER_PORT`` the master container's ``pytorchjob-port``, ``WORLD_SIZE``
    the replicas of all types times ``nprocPerNode`` (1 when unset or not a number), ``RANK`` the index (workers
    after the master), then the container's own ``env`` of the manifest.
    """
    specs = job["spec"]["pytorchReplicaSpecs"]
    replicas = sum(spec["replicas"] for spec in specs.values())
    nproc = str(job["spec"].get("nprocPerNode", "auto"))
    port = next(p["containerPort"] for p in pytorch_container(job, "Master")["ports"] if p["name"] == "pytorchjob-port")
    master, rank = f"{job['metadata']['name']}-master-0", index + (1 if replica_type == "Worker" else 0)
    env = {"PYTHONUNBUFFERED": "1", "MASTER_ADDR": master, "MASTER_PORT": str(port), "PET_MASTER_ADDR": master,
           "PET_MASTER_PORT": str(port), "WORLD_SIZE": str(replicas * (int(nproc) if nproc.isdigit() else 1)),
           "RANK": str(rank), "PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": str(rank), "PET_NNODES": str(replicas)}  # fmt: skip
    return {**env, **{e["name"]: str(e["value"]) for e in pytorch_container(job, replica_type).get("env", [])}}


@contextmanager
def service_names(net: EmulatedNetwork, names: dict[str, int]) -> Iterator[None]:
    """Make each name resolve to host ``names[name]``'s address inside every host (``/etc/netns/<ns>/hosts``)."""
    root = Path("/etc/netns")
    made_root = not root.exists()
    lines = "127.0.0.1 localhost\n" + "".join(f"{net.host_ip(i)} {name}\n" for name, i in names.items())
    dirs = [root / net.namespace(i) for i in range(net.num_hosts)]
    try:
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(lines)
        yield
    finally:
        for d in dirs:
            (d / "hosts").unlink(missing_ok=True)
            if d.exists():
                d.rmdir()
        if made_root:
            try:
                root.rmdir()
            except OSError:  # another job's namespaces are using it
                pass


@pytest.mark.standalone
@pytest.mark.skipif(not AVAILABLE, reason=f"needs network namespaces: {REASON}")
def test_pytorchjob_pods_train_bmuf_without_torchrun(tmp_path):
    """The documented PyTorchJob (1 Master + 1 Worker) on two emulated hosts, each pod started as ``python train.py``
    with exactly the operator's variables: Lightning selects KubeflowEnvironment on both, and BMUF trains and agrees
    as under torchrun (world size 2, node ranks 0 and 1, finite metrics, the same consensus weights)."""
    job = documented_job()
    pods = [("Master", 0), ("Worker", 0)]  # host h runs pod h
    assert [job["spec"]["pytorchReplicaSpecs"][t]["replicas"] for t in ("Master", "Worker")] == [1, 1]
    services = {f"{job['metadata']['name']}-{t.lower()}-{i}": h for h, (t, i) in enumerate(pods)}
    out = tmp_path / "result.json"
    base = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    with EmulatedNetwork(num_hosts=2, rate="1gbit") as net, service_names(net, services):
        envs = [{**base, "OMP_NUM_THREADS": "1", **pod_env(job, t, i), "GLOO_SOCKET_IFNAME": net.ifname(h)}
                for h, (t, i) in enumerate(pods)]  # fmt: skip
        assert [(e["MASTER_ADDR"], e["RANK"], e["WORLD_SIZE"]) for e in envs] == [("pdist-bmuf-master-0", "0", "2"),
                                                                                  ("pdist-bmuf-master-0", "1", "2")]
        command = [sys.executable, *job_args("bmuf", out, environment="kubeflow")]
        run_on_hosts(net, [command, command], envs, tmp_path, timeout=180)
    results = read_results(out)
    assert [r["cluster_environment"] for r in results] == ["KubeflowEnvironment"] * 2
    assert_trained_and_agree(results)


def test_a_pod_is_not_detected_without_the_plugin(monkeypatch):
    """Why docs/multinode.md passes ``plugins=[KubeflowEnvironment()]``: with only a worker pod's variables, Lightning
    picks LightningEnvironment, which would start the processes itself and take node rank 0 although the pod's RANK is
    1; with the plugin, the ranks come from the pod and Lightning starts nothing."""
    for key in [k for k in os.environ if LAUNCHER_VARS.match(k)]:
        monkeypatch.delenv(key)
    for key, value in pod_env(documented_job(), "Worker", 0).items():
        monkeypatch.setenv(key, value)
    kwargs = dict(accelerator="cpu", devices=1, num_nodes=2, strategy="bmuf", logger=False)
    bare = Trainer(**kwargs).strategy.cluster_environment
    assert type(bare) is LightningEnvironment
    assert not bare.creates_processes_externally and bare.node_rank() == 0
    pod = Trainer(**kwargs, plugins=[KubeflowEnvironment()]).strategy.cluster_environment
    assert type(pod) is KubeflowEnvironment
    assert pod.creates_processes_externally and (pod.global_rank(), pod.node_rank(), pod.world_size()) == (1, 1, 2)
