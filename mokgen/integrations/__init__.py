"""Bindings of mokgen to the frameworks people train with (optional extras; each module imports its framework).

* :mod:`mokgen.integrations.transformers`: Hugging Face transformers' experts backend ``"mokgen"``
  (``pip install 'mokgen[transformers]'``).
"""
