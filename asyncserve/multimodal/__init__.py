"""Multimodal input: images fetched or decoded (media.py), turned into expanded prompt ids and
per-image items by a model's processor (processor.py), encoded on the worker."""
