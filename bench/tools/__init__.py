"""Measuring tools run with python -m: decode traces, server load, learning curves, store costs."""
