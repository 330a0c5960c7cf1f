"""`meshlm launch` starts every service at once (launcher.py): a service that dies during
start-up is named in the launcher's error with the end of its own output, and the others are
stopped; the healthy path is what every other e2e test's `system` fixture runs."""

from __future__ import annotations

import psutil
import pytest

from meshlm.launch.launcher import LaunchPlan, free_port, launch


def test_a_service_dying_at_start_up_is_named_with_its_output(smollm_path: str, tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    plan = LaunchPlan(
        model_path=str(missing),  # the scheduler fails to resolve it; the others start fine
        tokenizer_path=smollm_path,
        http_port=free_port(),
        grpc_port=free_port(),
        log_level="warning",
    )
    with pytest.raises(RuntimeError) as err:
        launch(plan, ready_timeout_s=180)
    message = str(err.value)
    assert message.startswith("scheduler-0 exited with code 1 during start-up"), message
    assert "the end of its output" in message and "does not exist" in message and str(missing) in message
    left = [p.cmdline() for p in psutil.Process().children(recursive=True) if "-m" in p.cmdline()]
    assert not left, f"services left running: {left}"
    print(message)
