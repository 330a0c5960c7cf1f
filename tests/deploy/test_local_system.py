"""The umbrella chart's rendered commands start a working system: render it in CPU mode with one
replica each, run every init container and container as a local process (kubelet.py maps
services, ports and volumes onto loopback and temp dirs), wait for the rendered probes, complete
a request through the gateway, run the `helm test` hook, then SIGTERM and expect a clean drain.
Every variant takes the API key and the internal token from one Secret (global.meshlm.auth), so
each link, the pd variant's handover too, carries the token. The mtls variant sets tls.enabled
in every chart, with the Secret's files from a throwaway CA: the rendered --tls-* flags and the
probes on the plaintext health port must work as rendered."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshlm.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tests.tls_certs import make_pki

from .charts import COMPONENTS, NAMESPACE, example, flags, manifests, render
from .kubelet import LocalCluster

API_KEY = "deploy-test-key"
INTERNAL_TOKEN = "deploy-test-internal-token"


def post(url: str, body: dict[str, Any], key: str | None) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 (loopback)
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def plaintext_health(address: str) -> int | None:
    """grpc.health.v1 Check over a plaintext channel: the status, or None when refused."""
    try:
        with grpc.insecure_channel(address) as ch:
            req = health_pb2.HealthCheckRequest()
            return health_pb2_grpc.HealthStub(ch).Check(req, timeout=5).status
    except grpc.RpcError:
        return None


def tokenize_code(address: str, key: str | None) -> grpc.StatusCode:
    """The status of a Tokenize call on the public gRPC API, with `key` as bearer token."""
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    req = tokenizer_pb2.TokenizeRequest(prompt=tokenizer_pb2.Prompt(text="hi"))
    try:
        with grpc.insecure_channel(address) as ch:
            tokenizer_pb2_grpc.TokenizerServiceStub(ch).Tokenize(req, metadata=metadata, timeout=30)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tls,pd", [(False, False), (True, False), (False, True)], ids=["plaintext", "mtls", "pd"])
def test_rendered_umbrella_runs_as_local_processes(
    umbrella: Path, smollm_path: str, tmp_path: Path, tls: bool, pd: bool
) -> None:
    values = example("cpu")
    if pd:  # prefill/decode disaggregation: the request crosses both scheduler pods
        values["scheduler"]["role"] = "prefill"
        values["decode"] = {**values["scheduler"], "enabled": True, "role": "decode"}
    # the API key and the ring's internal token from one Secret, as files: every link carries it
    values.setdefault("global", {}).setdefault("meshlm", {})["auth"] = {"existingSecret": "meshlm-auth"}
    secret_files: dict[str, Path] = {}
    if tls:  # the kubelet maps every Service to 127.0.0.1: the certificate names that IP
        secret_files["meshlm-tls"] = make_pki(tmp_path / "meshlm-tls").ca_file.parent
        for component in COMPONENTS:
            values.setdefault(component, {})["tls"] = {"enabled": True, "secretName": "meshlm-tls"}
    docs = manifests(render(umbrella, values))
    hooks = [d for d in docs if d["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    docs = [d for d in docs if d not in hooks]
    cluster = LocalCluster(
        docs,
        tmp_path / "pods",
        NAMESPACE,
        {("meshlm-auth", "api-key"): API_KEY, ("meshlm-auth", "internal-token"): INTERNAL_TOKEN},
        secret_files,
    )
    try:
        # Seed each pod's model emptyDir with this machine's conversion cache, so the init
        # containers' resolve_model_path() is a cache hit instead of a 30 s GGUF conversion.
        for pod in cluster.pods.values():
            if pod.spec.get("initContainers"):
                (pod.volume("models") / "cache").mkdir()
                (pod.volume("models") / "cache" / "models").symlink_to(Path(smollm_path).parent)
        cluster.run_init_containers(timeout_s=120)
        for pod in cluster.pods.values():
            if pod.spec.get("initContainers"):
                assert (pod.volume("models") / "model" / "tokenizer.json").is_file(), pod.name
        cluster.start()
        for pod in cluster.pods.values():  # every peer address named a rendered Service
            argv = cluster.argv(pod, pod.spec["containers"][0])
            pod_flags = flags({"args": argv[3:]})
            for flag, value in pod_flags.items():
                if flag.endswith("-addrs"):
                    assert value.startswith("127.0.0.1:"), (pod.name, flag, value)
            if tls:  # the Secret's files, mounted where the flags point
                assert pod_flags["tls-ca-file"] == str(pod.volume("tls") / "ca.crt"), pod.name
        cluster.wait_ready(timeout_s=180)  # under TLS the probes use the plaintext health port
        tok = cluster.pods["tokenizer"]
        grpc_status = plaintext_health(f"127.0.0.1:{tok.ports[tok.named['grpc']]}")
        serving = health_pb2.HealthCheckResponse.SERVING
        assert grpc_status == (None if tls else serving)  # TLS refuses a plaintext client
        if not tls:  # health is open, the public gRPC API needs the key from the Secret
            assert tokenize_code(f"127.0.0.1:{tok.ports[tok.named['grpc']]}", None) == grpc.StatusCode.UNAUTHENTICATED
            assert tokenize_code(f"127.0.0.1:{tok.ports[tok.named['grpc']]}", API_KEY) == grpc.StatusCode.OK

        gw = cluster.pods["gateway"]
        url = f"http://127.0.0.1:{gw.ports[gw.named['http']]}"
        body = {
            "text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        }
        status, out = post(url + "/generate", body, API_KEY)
        assert status == 200, out
        assert out["meta_info"]["completion_tokens"] == 4 and out["text"].strip(), out
        assert out["meta_info"]["finish_reason"]["type"] == "length", out
        status, out = post(url + "/generate", body, None)
        assert status == 401, out  # the key from the Secret is enforced

        (hook,) = hooks
        rc, log = cluster.run_pod(hook, tmp_path / "helm-test", timeout_s=120)
        assert rc == 0 and "meshlm ok:" in log, log

        codes = cluster.stop()
        assert codes == {name: 0 for name in cluster.pods}, (
            codes,
            {n: p.log(n) for n, p in cluster.pods.items()},
        )
    finally:
        cluster.close()
