"""The engine's short import path: `from serving.engine import Engine` (`serving.core.engine`)."""
from serving.core.engine import Engine, RequestOutput  # noqa: F401
