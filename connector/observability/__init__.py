"""Observability: metric definitions and recorder, Prometheus exposition, per-request traces,
the rate-limited log and the freeze watch. Imports only the contracts; other layers may import it.
"""
