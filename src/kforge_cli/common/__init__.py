"""Small torch-free helpers every room uses (safe writes and capped reads, JSON value narrowing,
prepare-data defaults). Imports nothing from kforge but ``errors``."""
