"""specserve: a speculative-decoding LLM serving engine."""
from .config import EngineConfig
from .core import RequestOutput, SamplingParams
from .engine.llm import LLM

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
