"""engine.resilience"""
