"""Tools on top of every layer: the `nixl-pd` command, its source-tree finder and the doctor.

Tools may import any package; no package imports tools (tests/test_import_graph.py).
"""
