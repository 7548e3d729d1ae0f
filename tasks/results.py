"""What each task returns to a client: small typed results, parsed by the task specs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Label:
    label: str
    score: float


@dataclass(frozen=True)
class Entity:
    text: str
    label: str
    start: int
    end: int
    score: float


@dataclass(frozen=True)
class Answer:
    text: str
    start: int
    end: int
    score: float


@dataclass(frozen=True)
class Ranked:
    index: int
    score: float
    document: str
