"""Tengyun: LLM inference and serving for Qwen-family models."""

from tengyun.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from tengyun.config import EngineConfig
from tengyun.lora.request import LoRARequest
from tengyun.outputs import CompletionOutput, RequestOutput
from tengyun.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in torch; import it lazily so `import tengyun` stays light.
    if name == "LLM":
        from tengyun.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "EngineConfig", "RequestOutput", "CompletionOutput",
           "LoRARequest", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "__version__"]
