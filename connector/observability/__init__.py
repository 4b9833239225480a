"""Observability: metric definitions and recorder, Prometheus exposition, per-request traces
and the rate-limited log. Imports only the contracts; every other layer may import it.
"""
