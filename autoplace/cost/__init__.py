"""The cost model: the single source of every byte, second and FLOP autoplace reports.

Small pure functions (one formula, one citation each) vectorized with numpy over arrays of
candidate plans; :func:`autoplace.cost.evaluate.evaluate` assembles them for one plan and
:func:`autoplace.cost.evaluate.evaluate_batch` for many.
"""
