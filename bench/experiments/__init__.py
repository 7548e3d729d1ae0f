"""One-off measurements behind the "What was tried" section of BENCHMARKS.md.

Each runs on the bench repository (``make bench`` exports it first) and prints
its figures; none is part of ``make bench`` because each answers one question.
"""
