"""setup_telemetry without an OTLP endpoint installs no SDK provider: spans do not record, and a
request's incoming trace context still passes through to the next service; with an endpoint the
spans record (and export). Each case runs in a subprocess: a tracer provider is process-global."""

from __future__ import annotations

import subprocess
import sys

PROBE = r"""
import sys
from opentelemetry import trace
from meshlm.common import telemetry

endpoint = sys.argv[1] or None
telemetry.setup_telemetry("probe", endpoint)
incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
with telemetry.span("http probe", incoming) as s:
    passed, _ = telemetry.current_traceparent(s)
    recording = s.is_recording()
assert passed.split("-")[1] == "0af7651916cd43dd8448eb211c80319c", passed
print("recording" if recording else "not recording", flush=True)
import os
os._exit(0)  # no exit-time export to an endpoint where nothing listens
"""


def probe(endpoint: str) -> str:
    result = subprocess.run([sys.executable, "-c", PROBE, endpoint], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_without_an_endpoint_spans_do_not_record_but_the_trace_passes_through() -> None:
    assert probe("") == "not recording"


def test_with_an_endpoint_spans_record() -> None:
    assert probe("127.0.0.1:1") == "recording"
