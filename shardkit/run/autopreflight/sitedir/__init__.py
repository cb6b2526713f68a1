"""Holds only ``sitecustomize.py`` (see shardkit.run.autopreflight); a package so wheels ship it."""
