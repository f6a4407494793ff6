"""Bindings of mokgen to the frameworks people train with (optional extras; the transformers backend imports
transformers, the torchtitan and Megatron adapters read their modules' attributes and import neither framework).

* :mod:`mokgen.integrations.transformers`: Hugging Face transformers' experts backend ``"mokgen"``
  (``pip install 'mokgen[transformers]'``).
* :mod:`mokgen.integrations.grouped`: the grouped-experts op for frameworks that dispatch tokens themselves
  (rows sorted by expert + counts + optional per-row probs, on mokgen's kernels; no framework needed).
* :mod:`mokgen.integrations.torchtitan`: torchtitan's ``GroupedExperts`` (``pip install 'mokgen[torchtitan]'``).
* :mod:`mokgen.integrations.megatron`: Megatron-core's ``TEGroupedMLP`` / ``SequentialMLP``
  (``pip install 'mokgen[megatron]'``, Python >= 3.12).
"""
