"""Host runtime of CapyCTL: GPU probe, engine kinds and process supervision.

This package never imports Django or anything from ``capyctl``: the control plane uses it
in-process for the standalone host, and the host agent uses it on remote machines.
"""
