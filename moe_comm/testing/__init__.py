"""Helpers for testing code that calls moe-comm (``contract``: a recording ``Buffer``)."""
