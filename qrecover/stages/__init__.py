"""Compression as stages, each a small function over plain objects (see README "How compression works"):

``transform`` (optional, function-preserving, model-level) -> ``calibrate`` (only the statistics the chosen
quantizers and the damage estimate need) -> ``candidates`` (every unit at every allowed encoding, with its
estimated damage) -> ``allocate`` (the knapsack of :mod:`qrecover.allocate`) -> ``finalize`` (re-quantize
each layer with its chosen encoding on the outputs of the already quantized layers before it) -> ``write``.

One module per stage: ``transform``, ``calibrate`` (its statistics and the stage's plan live in
:mod:`qrecover.calibrate`, below the stages: recovery's SVD initialisation uses them too), ``candidates``
(and :func:`~qrecover.stages.candidates.prepare`, which runs the stages up to it), ``allocation``,
``finalize``, ``write`` (the packed tensors and the manifest); ``checks``: refusals before work; encodings are
written as specs, parsed in ``specs``. :func:`qrecover.api.compress` wires them.
"""
