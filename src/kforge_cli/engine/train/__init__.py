"""engine.train"""
