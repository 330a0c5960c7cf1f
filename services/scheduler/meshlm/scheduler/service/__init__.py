"""meshlm.scheduler.service: the scheduler as a gRPC service (meshlm.v1.SchedulerService).

config.py        SchedulerServiceConfig (+ engine flags), CLI and MESHLM_SCHEDULER_* env
wire.py          protobuf <-> io_struct conversion (protobuf stays out of the loop)
tracker.py       per-request ring state: origin, seed, output ids, resync
servicer.py      SchedulerServicer: Connect (per tokenizer) and GetModelInfo
detok_client.py  the Push stream to a detokenizer, fail-over and resync
observability.py Prometheus metrics and scheduler.* spans
server.py        SchedulerServer / serve() / main(): process wiring and drain
"""

from meshlm.scheduler.service.config import SchedulerServiceConfig
from meshlm.scheduler.service.server import SchedulerServer, main, serve

__all__ = ["SchedulerServer", "SchedulerServiceConfig", "main", "serve"]
