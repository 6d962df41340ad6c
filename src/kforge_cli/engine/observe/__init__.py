"""engine.observe"""
