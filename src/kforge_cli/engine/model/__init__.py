"""engine.model"""
