"""Container health check: exits 0 when the gRPC server at $TANDEM_HEALTH_ADDRESS reports SERVING (grpc.health.v1).

Plaintext only, like kubelet's gRPC probe; a service with TLS on is checked by Kubernetes with a TCP probe instead.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    address = os.environ.get("TANDEM_HEALTH_ADDRESS", "127.0.0.1:50051")
    with grpc.insecure_channel(address) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=4)
        except grpc.RpcError as error:
            print(f"{address}: {error.code().name}", file=sys.stderr)
            return 1
    serving = answer.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
