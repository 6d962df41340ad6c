"""engine.runtime"""
