"""TLS: a server with a certificate is reachable only by clients that verify it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.errors import PipelineError
from pipelinerl.common.health import wait_until_serving
from pipelinerl.reward import server as reward_server
from pipelinerl.reward.client import RewardClient
from tests.fakes import FakeReward

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    return make_certificate(tmp_path)


async def test_tls_server_accepts_verifying_clients_only(start_server, certificate) -> None:
    cert, key = certificate
    address = await start_server(
        reward_server.registration(FakeReward()), tls_cert_file=cert, tls_key_file=key
    )
    async with RewardClient(ChannelConfig(address, tls_ca_file=cert)) as client:
        assert [v.name for v in await client.list_verifiers()] == ["exact"]
    async with RewardClient(ChannelConfig(address, max_attempts=1)) as plaintext:
        with pytest.raises(PipelineError) as exc:
            await plaintext.list_verifiers(timeout_s=3)
        assert exc.value.code == "UNAVAILABLE"


async def test_health_check_of_a_tls_server_verifies_it_with_the_ca(start_server, certificate) -> None:
    cert, key = certificate
    address = await start_server(
        reward_server.registration(FakeReward()), tls_cert_file=cert, tls_key_file=key
    )
    assert await wait_until_serving(address, timeout_s=5, tls_ca_file=cert)
    assert not await wait_until_serving(address, timeout_s=0.5)
