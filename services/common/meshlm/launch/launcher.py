"""Start the four services as separate processes on loopback (`meshlm launch`).

Every process starts at once (detokenizers, schedulers, tokenizers, gateway, in that order
of Popen): each client among them dials its peers with backoff (common/peer_stream.py), so
nobody needs the others up first, and the slow scheduler start-up (model load) overlaps the
others'. Each process is a plain `python -m meshlm.<component>` with flags, exactly what a
container would run. The launcher waits until every gRPC service reports SERVING and the
gateway answers /health (all of them polled together, each one's ready time logged), then
supervises: Ctrl-C / SIGTERM stops all of them (SIGTERM, grace period, then SIGKILL). Each
child's output is copied to the launcher's stderr through an OutputTail (output_tail.py); a
child that exits during start-up is named in the error with the end of its own output.
With a TlsConfig every process gets the same --tls-* flags (the gRPC links use TLS, mTLS with a
CA) and the launcher's own health checks use them too; the certificate must name the host the
services are dialed by (an IP SAN for 127.0.0.1).

Secrets never go on a command line (anyone can read another process's argv, /proc/<pid>/cmdline;
its environment only its own user): the API key reaches the gateway and the tokenizers as
MESHLM_<COMPONENT>_API_KEY, the internal token every process as MESHLM_<COMPONENT>_INTERNAL_TOKEN.
With an API key and no internal token the launcher makes a random one, so the loopback ports of
the schedulers and detokenizers are closed to callers without it too. The children's auth comes
from the plan alone: inherited MESHLM_<COMPONENT>_API_KEY* / _INTERNAL_TOKEN* variables are
dropped.

Several schedulers on one host (--dp-size > 1, or a prefill and a decode role) split its CPUs:
each gets OMP_NUM_THREADS = max(1, cpus // schedulers) (cpus: common/cpus.py, this process's
affinity capped by its cgroup quota), as
vLLM and SGLang bind disjoint cores per CPU data-parallel rank, so their OpenMP threads do not
spin against each other's; an OMP_NUM_THREADS already in the environment is kept.
With batch_relays (`meshlm launch --batch-relays`) the relays (gateway, tokenizers,
detokenizers) run with --batch-scheduling: their many short wake-ups then wait for a scheduler
thread's time slice instead of preempting it in the middle of a GEMM (common/cpus.py
batch_scheduling). Off by default: it gained 7-12% of output tok/s at concurrency 64 on a 2-core
Xeon whose second vCPU is shared, nothing on a 2-core EPYC, where it cost 3% at concurrency 1.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshlm.common.cpus import available_cpus
from meshlm.common.ports import free_port
from meshlm.common.tls import FLAGS as TLS_FLAGS
from meshlm.common.tls import PLAINTEXT, TlsConfig, sync_channel
from meshlm.launch.output_tail import OutputTail

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchPlan:
    """What to start; engine flags are passed to every scheduler verbatim."""

    model_path: str
    tokenizer_path: str
    host: str = "127.0.0.1"
    http_port: int = 30000
    grpc_port: int = 30001
    dp_size: int = 1
    # Prefill/decode disaggregation: > 0 makes the dp_size schedulers prefill schedulers that
    # hand requests to this many decode schedulers.
    decode_dp_size: int = 0
    tokenizer_replicas: int = 1
    detokenizer_replicas: int = 1
    scheduler_args: tuple[str, ...] = ()
    tokenizer_args: tuple[str, ...] = ()
    # Run the gateway, tokenizers and detokenizers under SCHED_BATCH (common/cpus.py
    # batch_scheduling), beside the schedulers on this host's cores.
    batch_relays: bool = False
    gateway_args: tuple[str, ...] = ()
    common_args: tuple[str, ...] = ()
    otlp_endpoint: str | None = None
    log_level: str = "info"
    tls: TlsConfig = PLAINTEXT
    # The public API key (gateway HTTP and the tokenizers' gRPC API) and the ring's internal
    # token; passed by environment only. launch() makes a token when there is a key but none.
    api_key: str | None = field(default=None, repr=False)
    internal_token: str | None = field(default=None, repr=False)

    def with_internal_token(self) -> LaunchPlan:
        """This plan, with a random internal token if it has an API key but no token."""
        if self.api_key is None or self.internal_token is not None:
            return self
        return dataclasses.replace(self, internal_token=secrets.token_urlsafe(32))


@dataclass
class Child:
    name: str
    component: str
    address: str  # host:port it serves (gRPC, or HTTP for the gateway)
    argv: list[str]
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict, repr=False)  # the secrets, as variables
    output: OutputTail | None = field(default=None, repr=False)  # set when launch() pipes its output


@dataclass
class System:
    """A running system. `stop()` ends every process; safe to call twice."""

    plan: LaunchPlan
    children: list[Child] = field(default_factory=list)

    def by_component(self, component: str) -> list[Child]:
        return [c for c in self.children if c.component == component]

    @property
    def http_url(self) -> str:
        return f"http://{self.plan.host}:{self.plan.http_port}"

    @property
    def grpc_address(self) -> str:
        return self.by_component("tokenizer")[0].address

    def stop(self, grace_s: float = 10.0) -> None:
        for c in reversed(self.children):
            if c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in reversed(self.children):
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0fs; killing", c.name, grace_s)
                c.proc.kill()
                c.proc.wait()


def _cmd(component: str, args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", f"meshlm.{component}", *args]


AUTH_VARS = ("API_KEY", "API_KEY_FILE", "INTERNAL_TOKEN", "INTERNAL_TOKEN_FILE")


def env_prefix(component: str) -> str:
    return f"MESHLM_{component.upper()}_"


def secret_env(plan: LaunchPlan, component: str) -> dict[str, str]:
    """The variables that give `component` the plan's secrets (the API key to the gateway and
    the tokenizers, the internal token to all)."""
    env = {}
    if plan.api_key is not None and component in ("gateway", "tokenizer"):
        env[env_prefix(component) + "API_KEY"] = plan.api_key
    if plan.internal_token is not None:
        env[env_prefix(component) + "INTERNAL_TOKEN"] = plan.internal_token
    return env


def scheduler_threads(plan: LaunchPlan) -> int | None:
    """OpenMP threads for each scheduler process when several share this host, else None."""
    n = plan.dp_size + plan.decode_dp_size
    if n <= 1:
        return None
    return max(1, available_cpus() // n)


def plan_children(plan: LaunchPlan) -> list[Child]:
    h = plan.host
    common = list(plan.common_args) + ["--log-level", plan.log_level]
    relay = ["--batch-scheduling"] if plan.batch_relays else []
    if plan.otlp_endpoint:
        common += ["--otlp-endpoint", plan.otlp_endpoint]
    for name, flag in TLS_FLAGS.items():
        path = getattr(plan.tls, name)
        if path is not None:
            common += [flag, path]
    detoks = [f"{h}:{free_port(h)}" for _ in range(plan.detokenizer_replicas)]
    scheds = [f"{h}:{free_port(h)}" for _ in range(plan.dp_size)]
    decodes = [f"{h}:{free_port(h)}" for _ in range(plan.decode_dp_size)]
    toks = [f"{h}:{plan.grpc_port}"] + [f"{h}:{free_port(h)}" for _ in range(plan.tokenizer_replicas - 1)]
    children: list[Child] = []
    for i, addr in enumerate(detoks):
        port = addr.rsplit(":", 1)[1]
        args = ["--host", h, "--port", port, "--tokenizer-path", plan.tokenizer_path, *relay, *common]
        children.append(Child(f"detokenizer-{i}", "detokenizer", addr, _cmd("detokenizer", args)))
    roles = [
        ("scheduler", a, ["--disaggregation-mode", "prefill", "--decode-addrs", ",".join(decodes)] if decodes else [])
        for a in scheds
    ]
    roles += [("decode-scheduler", a, ["--disaggregation-mode", "decode"]) for a in decodes]
    for name, addr, role_args in roles:
        i = (scheds if name == "scheduler" else decodes).index(addr)
        port = addr.rsplit(":", 1)[1]
        args = [
            "--host",
            h,
            "--port",
            port,
            "--scheduler-id",
            f"{name}-{i}",
            "--model-path",
            plan.model_path,
            "--tokenizer-path",
            plan.tokenizer_path,
            "--detokenizer-addrs",
            ",".join(detoks),
            *role_args,
            *plan.scheduler_args,
            *common,
        ]
        children.append(Child(f"{name}-{i}", "scheduler", addr, _cmd("scheduler", args)))
    for i, addr in enumerate(toks):
        port = addr.rsplit(":", 1)[1]
        args = [
            "--host",
            h,
            "--port",
            port,
            "--tokenizer-id",
            f"tokenizer-{i}",
            "--tokenizer-path",
            plan.tokenizer_path,
            "--scheduler-addrs",
            ",".join(scheds),
            "--detokenizer-addrs",
            ",".join(detoks),
            *plan.tokenizer_args,
            *relay,
            *common,
        ]
        children.append(Child(f"tokenizer-{i}", "tokenizer", addr, _cmd("tokenizer", args)))
    gw_args = [
        "--host",
        h,
        "--port",
        str(plan.http_port),
        "--tokenizer-addrs",
        ",".join(toks),
        *plan.gateway_args,
        *relay,
        *common,
    ]
    children.append(Child("gateway", "gateway", f"{h}:{plan.http_port}", _cmd("gateway", gw_args)))
    threads = scheduler_threads(plan)
    for c in children:
        c.env = secret_env(plan, c.component)
        if threads is not None and c.component == "scheduler":
            c.env["OMP_NUM_THREADS"] = str(threads)
    return children


def child_env(base: dict[str, str], child: Child) -> dict[str, str]:
    """base without any inherited auth variable of the child's component, plus its secrets and
    its CPU share (OMP_NUM_THREADS, unless base sets one)."""
    dropped = {env_prefix(child.component) + v for v in AUTH_VARS}
    own = {k: v for k, v in child.env.items() if not (k == "OMP_NUM_THREADS" and k in base)}
    return {**{k: v for k, v in base.items() if k not in dropped}, **own}


def _grpc_serving(address: str, timeout: float, tls: TlsConfig) -> bool:
    try:
        with sync_channel(address, tls) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _http_ok(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback)
            return r.status == 200
    except OSError:
        return False


_READY_STAGE = {"detokenizer": 0, "scheduler": 0, "tokenizer": 1, "gateway": 2}


def _is_ready(child: Child, tls: TlsConfig) -> bool:
    if child.component == "gateway":
        return _http_ok(f"http://{child.address}/health", 1.0)
    return _grpc_serving(child.address, 1.0, tls)


def _start_failure(child: Child, what: str) -> RuntimeError:
    """The error for a child that failed to start: its name, `what`, its last output lines."""
    message = f"{child.name} {what}"
    if child.output is not None and child.proc is not None and child.output.pid == child.proc.pid:
        if child.proc.poll() is not None:
            child.output.join(2.0)  # what it wrote before exiting
        tail = child.output.text()
        if tail:
            message += f"; the end of its output:\n{tail}"
    return RuntimeError(message)


def wait_ready(child: Child, timeout_s: float, tls: TlsConfig = PLAINTEXT) -> None:
    """Block until the child serves (gRPC health SERVING, over TLS when `tls` is enabled /
    HTTP /health 200) or fail."""
    wait_all_ready([child], timeout_s, tls)


def wait_all_ready(children: Sequence[Child], timeout_s: float, tls: TlsConfig = PLAINTEXT) -> None:
    """Block until every child serves (as wait_ready), polling all of them each round; raise
    RuntimeError naming the first child that exits meanwhile (with the end of its output when
    it is piped), TimeoutError naming those not ready within timeout_s."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    pending = list(children)
    while pending:
        for child in pending:
            assert child.proc is not None
            if child.proc.poll() is not None:
                raise _start_failure(child, f"exited with code {child.proc.returncode} during start-up")
        # A tokenizer serves once a scheduler and a detokenizer do, the gateway's /health once a
        # tokenizer does: asking them earlier would only take CPU from the start-ups.
        stage = min(_READY_STAGE[c.component] for c in pending)
        for child in [c for c in pending if _READY_STAGE[c.component] == stage]:
            if _is_ready(child, tls):
                pending.remove(child)
                logger.info("%s ready after %.1fs", child.name, time.monotonic() - t0)
        if not pending:
            return
        if all(_READY_STAGE[c.component] > stage for c in pending):
            continue  # a stage just finished: ask the next one at once
        if time.monotonic() >= deadline:
            names = ", ".join(c.name for c in pending)
            raise TimeoutError(f"{names} {'was' if len(pending) == 1 else 'were'} not ready within {timeout_s:.0f}s")
        time.sleep(0.2)


def launch(plan: LaunchPlan, ready_timeout_s: float = 300.0, env: dict[str, str] | None = None) -> System:
    """Start every process at once and wait until all are ready; on failure stop what started.
    The system's plan holds the internal token it used (made here when the plan has a key only)."""
    plan = plan.with_internal_token()
    system = System(plan)
    proc_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    t0 = time.monotonic()
    try:
        children = plan_children(plan)
        for c in children:
            logger.info("starting %s: %s", c.name, " ".join(c.argv))
            c.proc = subprocess.Popen(
                c.argv, env=child_env(proc_env, c), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            c.output = OutputTail.start(c.name, c.proc.stdout, c.proc.pid)
            system.children.append(c)
        wait_all_ready(children, ready_timeout_s, plan.tls)
    except BaseException:
        system.stop(grace_s=5.0)
        raise
    logger.info("all %d services ready in %.1fs", len(children), time.monotonic() - t0)
    return system
