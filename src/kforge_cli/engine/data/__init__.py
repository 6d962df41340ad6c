"""engine.data"""
