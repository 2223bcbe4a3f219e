"""Serving many requests from one decoder: continuous batching over the captured step.

``ContinuousBatcher`` owns a decoder's batch: requests join between steps and leave when done, each with a
``Stream`` handle that yields its tokens step by step (to threads or to asyncio tasks).
"""

from .batcher import BatcherConfig, ContinuousBatcher
from .stream import Chunk, Completion, EngineClosedError, QueueFullError, Stream

__all__ = ["BatcherConfig", "Chunk", "Completion", "ContinuousBatcher", "EngineClosedError", "QueueFullError",
           "Stream"]
