"""Importable test helpers (hooks referenced by import path from settings)."""
