"""Driver for tests/test_localnode.py, run in a subprocess whose environment turns Ray's TLS
on (``RAY_USE_TLS=1`` and the three certificate files) and gives it a private
``RAY_TMPDIR``: a two-node Ray on 127.0.0.1 (``ray.cluster_utils.Cluster``: a head with no
CPUs, a worker node with 2), joined through `raypipe.localnode.start`, one epoch of a
`raypipe.Pipeline` across it (its actors run on the worker node, its batches are read on
the head), and three gRPC calls to the GCS: without TLS, with TLS but no client
certificate, and with the certificate.

``python -m tests.tls_driver DATA OUT``: writes to OUT (JSON) the nodes alive, the epoch's
keys, and each call's outcome (``"ok"`` or the gRPC status name).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from raypipe import Pipeline, PipelineConfig, localnode

STORE = 80 << 20


def _call_gcs(address: str, credentials) -> str:
    """``GetAllNodeInfo`` on the GCS over a channel with these credentials (None: plain)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=10)
        except grpc.RpcError as e:
            return e.code().name
    return "ok"


def _refusals(address: str) -> dict[str, str]:
    import grpc

    read = {v: Path(os.environ[v]).read_bytes() for v in localnode.TLS_FILES}
    ca, cert, key = (read["RAY_TLS_CA_CERT"], read["RAY_TLS_SERVER_CERT"],
                     read["RAY_TLS_SERVER_KEY"])  # fmt: skip
    return {
        "plain": _call_gcs(address, None),
        "tls_without_certificate": _call_gcs(address, grpc.ssl_channel_credentials(ca)),
        "tls_with_certificate": _call_gcs(address, grpc.ssl_channel_credentials(ca, key, cert)),
    }


def main(data: str, out: str) -> None:
    node = {"node_ip_address": "127.0.0.1", "object_store_memory": STORE}
    cluster = Cluster(shutdown_at_exit=True)
    try:
        cluster.add_node(num_cpus=0, include_dashboard=False, **node)
        cluster.add_node(num_cpus=2, **node)
        localnode.start(cluster.address, log_to_driver=False, configure_logging=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        config = PipelineConfig(source=data, image_size=8, batch_size=4, actors=(1, 1),
                                actor_cpus=0.5)  # fmt: skip
        keys = []
        with Pipeline(config, epochs=1) as pipeline:
            for _, batches in pipeline.epochs():
                for batch in batches:
                    keys += batch["key"].tolist()
        report = {
            "nodes": sum(n["Alive"] for n in ray.nodes()),
            "keys": keys,
            "calls": _refusals(cluster.address),
        }
        Path(out).write_text(json.dumps(report))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
