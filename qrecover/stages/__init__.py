"""Compression as stages, each a small function over plain objects (see README "How compression works"):

``transform`` (optional, function-preserving, model-level) -> ``calibrate`` (only the statistics the chosen
quantizers and the damage estimate need) -> ``candidates`` (every unit at every allowed encoding, with its
estimated damage) -> ``allocate`` (the knapsack of :mod:`qrecover.allocate`) -> ``finalize`` (re-quantize
each layer with its chosen encoding on the outputs of the already quantized layers before it) -> ``write``.

:func:`qrecover.api.prepare` runs the stages up to ``candidates``; :func:`qrecover.api.compress` the rest.
Encodings are written as specs, parsed in :mod:`qrecover.stages.specs`.
"""
