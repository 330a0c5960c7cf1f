"""What every route needs: the config, the tokenizer pool, and the served model's info (cached)."""

from __future__ import annotations

import time

from fastapi import Request

from meshlm.gateway.config import GatewayConfig
from meshlm.gateway.errors import APIError
from meshlm.gateway.grpc_client import TokenizerPool
from meshlm.v1 import common_pb2

CONTROL_TIMEOUT_S = 30.0  # deadline of control calls (model info, flush, sessions, abort)


class GatewayState:
    def __init__(self, config: GatewayConfig, pool: TokenizerPool | None = None) -> None:
        self.config = config
        self.pool = pool or TokenizerPool(config.tokenizer_addrs, tls=config.tls, token=config.tokenizer_token)
        self.started = int(time.time())
        self._model_info: common_pb2.ModelInfo | None = None

    @property
    def control_timeout_s(self) -> float:
        return min(CONTROL_TIMEOUT_S, self.config.request_timeout_s)

    async def model_info(self, timeout: float | None = None) -> common_pb2.ModelInfo:
        """GetModelInfo from a tokenizer, fetched once (the model does not change while serving)."""
        if self._model_info is None:  # concurrent first fetches are harmless
            self._model_info = await self.pool.get_model_info(timeout=timeout or self.control_timeout_s)
        return self._model_info

    def cached_model_info(self) -> common_pb2.ModelInfo | None:
        return self._model_info

    async def served_model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        info = await self.model_info()
        return info.served_model_name or info.model_path

    async def check_model(self, model: str | None) -> str:
        """The served model name; 404 model_not_found when the request names another model."""
        name = await self.served_model_name()
        if model is not None and model != name:
            raise APIError(
                404,
                f"The model `{model}` does not exist (this server serves `{name}`)",
                param="model",
                code="model_not_found",
            )
        return name


def get_state(request: Request) -> GatewayState:
    return request.app.state.gateway
