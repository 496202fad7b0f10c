"""Mutual TLS between the gateway and the services: TLS-configured services refuse
plaintext and clients without a certificate their CA signed."""

from __future__ import annotations

import subprocess

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.v1 import common_pb2, verify_pb2_grpc
from tests.conftest import free_port, start_stack, stop_process

HEALTH_PORT = free_port()


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""
    d = tmp_path_factory.mktemp("certs")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=specserve test CA", cwd=d)  # fmt: skip
    for name, san in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "subjectAltName=DNS:gateway"),
    ):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        (d / f"{name}.ext").write_text(san + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return d


@pytest.fixture(scope="module")
def mtls_stack(tiny_pair, certs):
    env = {}
    for service in ("VERIFY", "DRAFT"):
        env[f"SPECSERVE_{service}_TLS_CERT"] = str(certs / "server.pem")
        env[f"SPECSERVE_{service}_TLS_KEY"] = str(certs / "server.key")
        env[f"SPECSERVE_{service}_TLS_CLIENT_CA"] = str(certs / "ca.pem")
    env["SPECSERVE_VERIFY_HEALTH_PORT"] = str(HEALTH_PORT)
    env["SPECSERVE_GATEWAY_TLS_CA"] = str(certs / "ca.pem")
    env["SPECSERVE_GATEWAY_TLS_CERT"] = str(certs / "client.pem")
    env["SPECSERVE_GATEWAY_TLS_KEY"] = str(certs / "client.key")
    stack = start_stack(*tiny_pair, env=env)
    yield stack
    stop_process(stack.process)


def test_the_stack_serves_over_mutual_tls(mtls_stack):
    body = {"prompt": [3, 4, 5], "max_tokens": 12, "temperature": 0, "return_timings": True}
    reply = httpx.post(f"{mtls_stack.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["speculation"]["num_drafts"] >= 1


def test_services_refuse_plaintext_and_clients_without_a_certificate(mtls_stack, certs):
    request = common_pb2.ModelInfoRequest()
    with grpc.insecure_channel(mtls_stack.verify_address) as channel:
        with pytest.raises(grpc.RpcError) as plaintext:
            verify_pb2_grpc.VerifyServiceStub(channel).GetModelInfo(request, timeout=5)
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
    anonymous = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
    with grpc.secure_channel(mtls_stack.verify_address, anonymous) as channel:
        with pytest.raises(grpc.RpcError) as no_cert:
            verify_pb2_grpc.VerifyServiceStub(channel).GetModelInfo(request, timeout=5)
    assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE
    mutual = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes(), (certs / "client.key").read_bytes(),
                                          (certs / "client.pem").read_bytes())  # fmt: skip
    with grpc.secure_channel(mtls_stack.verify_address, mutual) as channel:
        assert verify_pb2_grpc.VerifyServiceStub(channel).GetModelInfo(request, timeout=5).vocab_size == 257


def test_a_plaintext_health_port_answers_probes_that_cannot_speak_tls(mtls_stack):
    with grpc.insecure_channel(f"127.0.0.1:{HEALTH_PORT}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as nothing_else:
            verify_pb2_grpc.VerifyServiceStub(channel).GetModelInfo(common_pb2.ModelInfoRequest(), timeout=5)
        assert nothing_else.value.code() == grpc.StatusCode.UNIMPLEMENTED
