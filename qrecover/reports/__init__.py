"""Evaluation reporting and release gating, torch-free.

``results``: the results-file schema that ``qrecover eval`` writes (one file per evaluated model).
``table``: scores normalised to the unquantized model, one row per bpw x {quantized, recovered}.
``render``: ``report.md``, ``report.json`` and ``report.html`` from those rows.
``gate``: pass/fail of a ``report.json`` against ratio thresholds, for CI.
"""
