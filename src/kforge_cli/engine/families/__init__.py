"""Model families (layer 2): the ``ModelFamily`` interface, its registry, and one package per family.

A family owns its modules and builder, its parallel plans as declarative data, its FLOPs per
token, its shapes and memory terms, its Hugging Face mapping and its settings; ``parallel/``,
``plan/``, ``interop/`` and the FLOPs count consume the interface (see docs/architecture.md).
"""
