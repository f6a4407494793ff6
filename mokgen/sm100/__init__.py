"""sm_100a (Blackwell, tcgen05): what differs from the shared stages, in one place.

* :mod:`mokgen.sm100.rules`: the tile rules, the tensor-memory and shared-memory budgets of the tcgen05 GEMMs;
* :mod:`mokgen.sm100.plan`: the plan's sm_100a rules (its kernels' form, MXFP8, the budget checks, their --explain
  lines), on the shared solver that :mod:`mokgen.plan` hands it;
* :mod:`mokgen.sm100.emit`: the renderer of ``templates/sm100/`` (its block library: ``templates/sm100/_blocks.py.j2``).

Its row of the arch table is ``mokgen.arch.ARCHS["sm_100a"]``. The shared stages reach it through one lookup each:
:data:`mokgen.plan.ARCH_RULES` (plan) and :data:`mokgen.emit.ARCH_RENDERERS` (emit). Its config space is still
``mokgen.space.SPACES["sm_100a"]``, a copy of sm_90a's (its plan rules refuse the knobs its kernels do not take).
"""
