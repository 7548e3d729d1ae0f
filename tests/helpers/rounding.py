"""How far two float32 computations of one sum may differ when they add its terms in another order.

A float32 sum of ``n`` terms, added in any order (sequentially, pairwise, in SIMD lanes of any width, with
or without fused multiply-adds), is within ``n * u * sum(|terms|)`` of the exact sum, ``u = eps / 2``
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 4.2); two such computations
(numpy and PyTorch, a matrix product in pieces and at once, the AVX2 and the AVX-512 kernel of one library)
are within ``n * eps * sum(|terms|)`` of each other.  The bound follows the terms, not the result: a sum
near zero of large terms of both signs may differ between two orders by far more than its own size times
eps, so a relative tolerance is the wrong kind for it.  Where every term is positive the two coincide.

The bound is the worst case; rounding errors mostly cancel, and the differences seen are a few eps.  A
mistake (a term dropped, a row mixed up) moves a result by a whole term, far beyond it.
"""

from __future__ import annotations

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)


def sum_atol(abs_sum, terms: int):
    """How far two float32 sums of ``terms`` terms whose magnitudes add to ``abs_sum`` may differ."""
    return terms * EPS32 * np.asarray(abs_sum, np.float64)


def matmul_atol(a, b) -> np.ndarray:
    """:func:`sum_atol` of each element of ``a @ b``: its ``a.shape[-1]`` products' magnitudes."""
    magnitudes = np.abs(np.asarray(a, np.float64)) @ np.abs(np.asarray(b, np.float64))
    return sum_atol(magnitudes, np.shape(a)[-1])


def maxsim_atol(queries: list[np.ndarray], documents: list[np.ndarray], mean: bool = False) -> np.ndarray:
    """``[len(queries), len(documents)]``: how far two float32 MaxSim computations of each pair may differ.

    Each query vector's dot products (``dim`` terms) err by at most their terms' bound, and so does their
    maximum; the query's sum of maxima adds ``len(query)`` more terms.  So a pair's bound is
    :func:`sum_atol` of ``dim + len(query)`` terms over, per query vector, its largest dot product of
    magnitudes; divided by the vector count for MeanMaxSim, whose division rounds once more, relative to
    the result (``rtol=EPS32`` covers it).  A pair with an empty side has nothing summed: both computations
    give the same constant."""
    bound = np.zeros((len(queries), len(documents)))
    for i, query in enumerate(queries):
        for j, document in enumerate(documents):
            if len(query) and len(document):
                biggest = np.abs(np.asarray(query, np.float64)) @ np.abs(np.asarray(document, np.float64)).T
                bound[i, j] = sum_atol(biggest.max(axis=1).sum(), query.shape[1] + len(query))
                bound[i, j] /= len(query) if mean else 1
    return bound


def assert_within(actual, desired, atol, rtol: float = 0.0) -> None:
    """``actual`` is ``desired`` to within ``atol`` (an array: one bound per element) plus ``rtol`` of it;
    numpy's ``assert_allclose`` takes one atol for all.  The message names the worst element."""
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    assert actual.shape == desired.shape, f"shapes differ: {actual.shape} != {desired.shape}"
    with np.errstate(invalid="ignore"):  # inf - inf, 0 * inf: equal infinities pass by ==, a NaN fails
        allowed = np.broadcast_to(atol, desired.shape) + rtol * np.abs(desired)
        diff = np.abs(actual - desired)
        bad = ~((actual == desired) | (diff <= allowed))
    if bad.any():
        at = np.unravel_index(np.argmax(np.where(bad, np.nan_to_num(diff - allowed, nan=np.inf), -np.inf)), bad.shape)
        raise AssertionError(f"{int(bad.sum())} of {bad.size} elements differ by more than float32 "
                             f"rounding allows; worst at {tuple(int(i) for i in at)}: {actual[at]!r} != "
                             f"{desired[at]!r}, off by {abs(actual[at] - desired[at]):.3g} where "
                             f"{allowed[at]:.3g} is allowed")
