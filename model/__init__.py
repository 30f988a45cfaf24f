"""DeepSeek-V4 models: `load_model`, `init_model`, `save_checkpoint`."""

from model.api import Model
from model.initialize import init_model
from model.checkpoint import load_model, save_checkpoint

__all__ = ["Model", "init_model", "load_model", "save_checkpoint"]
