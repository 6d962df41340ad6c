"""engine.checkpoint"""
