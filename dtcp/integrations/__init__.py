"""Integrations of dtcp with training frameworks.

Each submodule imports its framework; import only the one you use, e.g.
``dtcp.integrations.torchtitan`` (torchtitan 0.3.0, ``pip install "dtcp[torchtitan03]"``, or 0.2.2,
``pip install "dtcp[torchtitan]"``) or
``dtcp.integrations.transformers`` (transformers 5.23, ``pip install "dtcp[transformers]"``).
"""
