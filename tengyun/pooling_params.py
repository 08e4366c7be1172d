"""PoolingParams: what one pooling request asks for (vLLM 0.11's fields), checked against the model's
pooler by ``resolved``. A request carrying these instead of SamplingParams is prefill-only: its
prompt is computed, pooled, and the request finishes in the step that computes its last token."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tengyun.pooling_config import PoolingModel

# Fields a task reads (vLLM's valid_parameters); asking another task for them is a 400.
_TASK_FIELDS = {"embed": ("dimensions", "normalize"), "encode": ("dimensions", "normalize", "activation", "softmax"),
                "classify": ("activation", "softmax"), "score": ("activation", "softmax"), "reward": ()}


@dataclass
class PoolingParams:
    dimensions: int | None = None  # embed: Matryoshka output size (the model must support it)
    normalize: bool | None = None  # embed: L2-normalise (None: the model's pooler decides)
    activation: bool | None = None  # classify / score: softmax or sigmoid over the labels
    softmax: bool | None = None  # vLLM's older name of activation
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: --max-model-len of them)
    task: str | None = None  # embed / classify / score / encode / reward; None: set by the caller's method
    # Resolved by resolved() against the model; the worker reads these, never the request's None.
    pooling_type: str | None = None  # LAST / MEAN / CLS / ALL (encode and reward: ALL, one row per token)

    def resolved(self, model: PoolingModel, model_name: str) -> "PoolingParams":
        """A copy with the model's defaults filled in; ValueError naming the field a request got wrong."""
        task = self.task or model.tasks[0]
        if task not in model.tasks:
            raise ValueError(f"Task {task!r} is not supported by this model (--convert {model.convert} serves "
                             f"{', '.join(model.tasks)}).")
        given = [f for f in ("dimensions", "normalize", "activation", "softmax") if getattr(self, f) is not None]
        invalid = [f for f in given if f not in _TASK_FIELDS[task]]
        if invalid:
            raise ValueError(f"Task {task} only supports {list(_TASK_FIELDS[task])} parameters, does not support "
                             f"{invalid} parameters.")
        dimensions = self.dimensions if self.dimensions is not None else model.dimensions
        if self.dimensions is not None:
            check_dimensions(self.dimensions, model, model_name)
        activation = next((v for v in (self.activation, self.softmax) if v is not None), model.activation)
        return dataclasses.replace(
            self, task=task, dimensions=dimensions,
            normalize=model.normalize if self.normalize is None else self.normalize,
            activation=activation, softmax=None,
            pooling_type="ALL" if task in ("encode", "reward") else model.pooling_type)

    @property
    def uses_prefix_cache(self) -> bool:
        """Only the last row is pooled (LAST): a cached prefix's rows are not needed."""
        return self.pooling_type == "LAST"


def check_dimensions(dimensions: int, model: PoolingModel, model_name: str) -> None:
    """A request's `dimensions` against the model (vLLM's wording)."""
    if not model.is_matryoshka:
        raise ValueError(f'Model "{model_name}" does not support matryoshka representation, changing output '
                         f"dimensions will lead to poor results.")
    if dimensions < 1:
        raise ValueError("Dimensions must be greater than 0")
    if model.matryoshka_dimensions is not None and dimensions not in model.matryoshka_dimensions:
        raise ValueError(f'Model "{model_name}" only supports {list(model.matryoshka_dimensions)} matryoshka '
                         f"dimensions, use other output dimensions will lead to poor results.")
