"""The benchmark harness: the served path against in-process peers, in one run.

``nexus-sli bench`` (or ``make bench``) measures, on one machine and side by side,
sentence-transformers (the baseline), PyTorch, ONNX Runtime on the exported
graphs, and the exported repository served by the real Triton server, and
writes ``latest.json``, ``latest.md`` and ``latest.png``.  Heavy imports live in
the modules that need them, so importing this package is cheap.
"""
