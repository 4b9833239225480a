"""The planner: which bytes of a remote engine's KV go where in this rank's, as pure values.

The recipe (recipe.py) names its stages and the module that owns each; nothing here touches
NIXL, sockets, threads or clocks.
"""
