"""Run rendered pods as local processes: the smallest kubelet that shows the charts' commands work.

Each Deployment / StatefulSet (one replica) becomes a pod: its init containers run to completion,
then its container runs with the rendered command, args and env, as is. Only the Kubernetes
plumbing is mapped onto this machine:
  * each containerPort gets a free loopback port; `--port=` / `--metrics-port=` / `--health-port=`
    args are rewritten to it and `--host=0.0.0.0` to 127.0.0.1;
  * `<service>[.<ns>[.svc[.cluster.local]]]:<port>` in args and env becomes 127.0.0.1:<the local
    port of the pod that Service selects, for its targetPort>; unknown names are left alone;
  * a volume is a directory of the pod (emptyDir: shared by the pod's containers; secret: a copy
    of the files in `secret_files[secretName]`, or with `items` each item's file from the
    `secrets` dict, mode 0440 as defaultMode says), and a value under a container's mountPath is
    rewritten to it;
  * secretKeyRef env comes from the `secrets` dict; `python` is this interpreter.
Probes are evaluated as the kubelet would: grpc.health.v1 Check for `grpc`, GET for `httpGet`.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshlm.common.ports import free_port

from .charts import selects, workloads

ADDR = re.compile(r"(?<![\w.-])([a-z0-9](?:[-a-z0-9]*[a-z0-9])?)((?:\.[a-z0-9-]+)*):(\d+)\b")


@dataclass
class Pod:
    name: str
    spec: dict[str, Any]
    labels: dict[str, str]
    root: Path
    ports: dict[int, int] = field(default_factory=dict)  # containerPort -> loopback port
    named: dict[str, int] = field(default_factory=dict)  # port name -> containerPort
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def volume(self, name: str) -> Path:
        return self.root / "volumes" / name

    def log(self, container: str) -> str:
        path = self.root / f"{container}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


class LocalCluster:
    def __init__(
        self,
        docs: list[dict[str, Any]],
        root: Path,
        namespace: str,
        secrets: dict[tuple[str, str], str] | None = None,
        secret_files: dict[str, Path] | None = None,
    ) -> None:
        self.namespace = namespace
        self.secrets = secrets or {}
        secret_files = secret_files or {}
        self.pods: dict[str, Pod] = {}
        for w in workloads(docs):
            assert w["spec"].get("replicas", 1) == 1, f"{w['metadata']['name']}: run one replica locally"
            tpl = w["spec"]["template"]
            # Named by the workload's name label: its component, or scheduler-decode.
            name = w["metadata"]["labels"]["app.kubernetes.io/name"].removeprefix("meshlm-")
            pod = Pod(name, tpl["spec"], tpl["metadata"]["labels"], root / name)
            for c in tpl["spec"]["containers"]:
                for p in c.get("ports", []):
                    pod.ports[p["containerPort"]] = free_port()
                    pod.named[p["name"]] = p["containerPort"]
            for v in tpl["spec"]["volumes"]:
                if "secret" in v and "items" in v["secret"]:
                    pod.volume(v["name"]).mkdir(parents=True)
                    for item in v["secret"]["items"]:
                        path = pod.volume(v["name"]) / item["path"]
                        path.write_text(self.secrets[(v["secret"]["secretName"], item["key"])] + "\n")
                        path.chmod(v["secret"].get("defaultMode", 0o644))
                    continue
                if "secret" in v:
                    shutil.copytree(secret_files[v["secret"]["secretName"]], pod.volume(v["name"]))
                    continue
                assert "emptyDir" in v, f"{pod.name}: volume {v['name']} is not an emptyDir"
                pod.volume(v["name"]).mkdir(parents=True)
            self.pods[pod.name] = pod
        self.addresses: dict[tuple[str, int], int] = {}
        for svc in (d for d in docs if d["kind"] == "Service"):
            (pod,) = [p for p in self.pods.values() if selects(svc["spec"]["selector"], p.labels)]
            for port in svc["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                self.addresses[(svc["metadata"]["name"], port["port"])] = pod.ports[pod.named.get(target, target)]

    # ---- rewriting -----------------------------------------------------------------------------
    def _address(self, m: re.Match[str]) -> str:
        name, suffix, port = m.group(1), m.group(2), int(m.group(3))
        ns = self.namespace
        if (name, port) in self.addresses and suffix in (
            "",
            f".{ns}",
            f".{ns}.svc",
            f".{ns}.svc.cluster.local",
        ):
            return f"127.0.0.1:{self.addresses[(name, port)]}"
        return m.group(0)

    def _value(self, pod: Pod, c: dict[str, Any], value: str) -> str:
        mounts = {m["mountPath"]: pod.volume(m["name"]) for m in c.get("volumeMounts", [])}
        for path in sorted(mounts, key=len, reverse=True):
            if value == path or value.startswith(path + "/"):
                return str(mounts[path]) + value[len(path) :]
        return ADDR.sub(self._address, value)

    def _arg(self, pod: Pod, c: dict[str, Any], arg: str) -> str:
        if not (arg.startswith("--") and "=" in arg):
            return self._value(pod, c, arg)
        flag, value = arg.split("=", 1)
        if flag in ("--port", "--metrics-port", "--health-port"):
            return f"{flag}={pod.ports[int(value)]}"
        if flag == "--host" and value == "0.0.0.0":
            return "--host=127.0.0.1"
        return f"{flag}={self._value(pod, c, value)}"

    def argv(self, pod: Pod, c: dict[str, Any]) -> list[str]:
        command = [
            sys.executable if c["command"][0] == "python" else c["command"][0],
            *c["command"][1:],
        ]
        return command + [self._arg(pod, c, a) for a in c.get("args", [])]

    def env(self, pod: Pod, c: dict[str, Any]) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = self._value(pod, c, e["value"])
            else:
                ref = e["valueFrom"]["secretKeyRef"]
                env[e["name"]] = self.secrets[(ref["name"], ref["key"])]
        return env

    # ---- running -------------------------------------------------------------------------------
    def _start(self, pod: Pod, c: dict[str, Any]) -> subprocess.Popen:
        with open(pod.root / f"{c['name']}.log", "wb") as log:  # the child keeps its own copy of the fd
            proc = subprocess.Popen(
                self.argv(pod, c),
                env=self.env(pod, c),
                cwd=pod.root,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        pod.procs[c["name"]] = proc
        return proc

    def run_init_containers(self, timeout_s: float) -> None:
        """Every pod's init containers (one each at most here), the pods in parallel."""
        started = []
        for pod in self.pods.values():
            inits = pod.spec.get("initContainers", [])
            assert len(inits) <= 1
            started += [(pod, c, self._start(pod, c)) for c in inits]
        for pod, c, proc in started:
            rc = proc.wait(timeout=timeout_s)
            assert rc == 0, f"{pod.name}/{c['name']} exited {rc}:\n{pod.log(c['name'])}"

    def start(self) -> None:
        for pod in self.pods.values():
            for c in pod.spec["containers"]:
                self._start(pod, c)

    def probe(self, pod: Pod, probe: dict[str, Any]) -> bool:
        if "grpc" in probe:
            address = f"127.0.0.1:{pod.ports[probe['grpc']['port']]}"
            try:
                with grpc.insecure_channel(address) as ch:
                    req = health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", ""))
                    resp = health_pb2_grpc.HealthStub(ch).Check(req, timeout=probe.get("timeoutSeconds", 1))
                return resp.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False
        port = probe["httpGet"]["port"]
        url = f"http://127.0.0.1:{pod.ports[pod.named.get(port, port)]}{probe['httpGet']['path']}"
        try:
            with urllib.request.urlopen(url, timeout=probe.get("timeoutSeconds", 1)) as r:  # noqa: S310
                return 200 <= r.status < 400
        except OSError:
            return False

    def wait_ready(self, timeout_s: float) -> None:
        """Until every container's startup and readiness probes pass (a dead process fails)."""
        deadline = time.monotonic() + timeout_s
        pending = {(p.name, c["name"]) for p in self.pods.values() for c in p.spec["containers"]}
        while pending:
            for pod_name, c_name in sorted(pending):
                pod = self.pods[pod_name]
                c = next(x for x in pod.spec["containers"] if x["name"] == c_name)
                proc = pod.procs[c_name]
                assert proc.poll() is None, f"{pod_name} exited {proc.returncode}:\n{pod.log(c_name)}"
                if self.probe(pod, c["startupProbe"]) and self.probe(pod, c["readinessProbe"]):
                    pending.discard((pod_name, c_name))
            if pending and time.monotonic() > deadline:
                logs = "\n".join(f"--- {p}/{c}\n{self.pods[p].log(c)}" for p, c in sorted(pending))
                raise TimeoutError(f"not ready within {timeout_s:.0f}s: {sorted(pending)}\n{logs}")
            time.sleep(0.3)

    def run_pod(self, doc: dict[str, Any], root: Path, timeout_s: float) -> tuple[int, str]:
        """A bare Pod (a `helm test` hook) run to completion: (exit code, output)."""
        pod = Pod(doc["metadata"]["name"], doc["spec"], doc["metadata"]["labels"], root)
        root.mkdir(parents=True, exist_ok=True)
        for v in doc["spec"].get("volumes", []):
            pod.volume(v["name"]).mkdir(parents=True)
        (c,) = doc["spec"]["containers"]
        rc = self._start(pod, c).wait(timeout=timeout_s)
        return rc, pod.log(c["name"])

    def stop(self) -> dict[str, int | None]:
        """SIGTERM every container (as after the preStop hook), wait for the drain the pod spec
        allows (terminationGracePeriodSeconds - preStop sleep), SIGKILL what is left (rc None)."""
        for pod in self.pods.values():
            for proc in pod.procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for pod in self.pods.values():
            for c in pod.spec["containers"]:
                budget = pod.spec["terminationGracePeriodSeconds"] - int(
                    c["lifecycle"]["preStop"]["exec"]["command"][1]
                )
                try:
                    codes[pod.name] = pod.procs[c["name"]].wait(timeout=budget)
                except subprocess.TimeoutExpired:
                    codes[pod.name] = None
        self.close()
        return codes

    def close(self) -> None:
        for pod in self.pods.values():
            for proc in pod.procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
