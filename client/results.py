"""The client's result types: each task's spec defines its own (:mod:`nexus_sli.tasks.results`)."""

from nexus_sli.tasks.results import Answer, Entity, Label, M3Embedding, Ranked, SparseEmbedding

__all__ = ["Answer", "Entity", "Label", "M3Embedding", "Ranked", "SparseEmbedding"]
