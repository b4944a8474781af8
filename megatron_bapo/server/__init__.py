"""Built-in CPU rollout server speaking SGLang's native HTTP API (transformers backend).

Run `python -m megatron_bapo.server --model-path DIR [--host 127.0.0.1] [--port 30000]`, or from
Python `megatron_bapo.server.launch.start_server(model_path)`. The endpoints, reply shapes and
quirks follow the shared SGLang native API spec (shared/specs/sglang-native-api.md) so the rollout client cannot tell it from
SGLang.
"""

from megatron_bapo.server.config import ServerConfig

__all__ = ["ServerConfig"]
