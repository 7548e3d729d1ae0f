"""A Triton that only describes its models: the two calls the gateway's discovery makes, answered from configs."""

from __future__ import annotations


class ConfigTriton:
    """``get_model_repository_index`` and ``get_model_config`` of Triton's asyncio client, from ``configs``
    (model name -> its config as Triton's JSON writes it); every model is ready."""

    def __init__(self, configs: dict):
        self.configs = configs

    async def get_model_repository_index(self, **_):
        return {"models": [{"name": name, "state": "READY"} for name in self.configs]}

    async def get_model_config(self, name, **_):
        return {"config": self.configs[name]}
