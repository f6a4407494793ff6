"""sm_100a (Blackwell, tcgen05): what differs from the shared stages, in one place.

* :mod:`mokgen.sm100.rules`: the tile rules, the tensor-memory and shared-memory budgets of the tcgen05 GEMMs;
* :mod:`mokgen.sm100.emit`: the renderer of ``templates/sm100/`` (its block library: ``templates/sm100/_blocks.py.j2``).

Its row of the arch table is ``mokgen.arch.ARCHS["sm_100a"]``. The shared stages reach it through one lookup each:
:data:`mokgen.emit.ARCH_RENDERERS` (emit).
"""
