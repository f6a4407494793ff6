"""sm_100a (Blackwell, tcgen05): what differs from the shared stages, in one place.

* :mod:`mokgen.sm100.rules`: the tile rules, the tensor-memory and shared-memory budgets of the tcgen05 GEMMs;
* :mod:`mokgen.sm100.plan`: the plan's sm_100a rules (its kernels' form, MXFP8, the budget checks, their --explain
  lines), on the shared solver that :mod:`mokgen.plan` hands it;
* :mod:`mokgen.sm100.emit`: the renderer of ``templates/sm100/`` (its block library: ``templates/sm100/_blocks.py.j2``);
* :mod:`mokgen.sm100.space`: its config space (the knobs its kernels take, their legal and searched values);
* :mod:`mokgen.sm100.configs`: the config space's constraints on an sm_100a plan (``mokgen.configs.check_plan``) and
  on an override dict (``check_config``, what ``mokgen tune`` enumerates).

Its row of the arch table is ``mokgen.arch.ARCHS["sm_100a"]``. The shared stages reach it through one lookup each:
:data:`mokgen.plan.ARCH_RULES` (plan), :data:`mokgen.emit.ARCH_RENDERERS` (emit), :data:`mokgen.space.SPACES` (the
config space) and :data:`mokgen.configs.ARCH_CONFIGS` (its constraints).
"""
