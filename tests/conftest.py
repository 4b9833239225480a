"""Test-wide settings: keep UCX on loopback and hypothesis within the CI time budget."""

import os

from hypothesis import HealthCheck, settings

# UCX opens lanes on every interface unless told otherwise; tests stay on loopback.
os.environ.setdefault("UCX_NET_DEVICES", "lo")

settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("ci")
