"""kvcached-serve: one OpenAI-compatible endpoint in front of several engines that share one
device's memory through kvcached (see docs/serve.md)."""

from kvcached_serve.config import ConfigError, ServeConfig, load_config, parse_config

__all__ = ["ConfigError", "ServeConfig", "load_config", "parse_config"]
__version__ = "0.1.0"
