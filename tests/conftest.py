"""Session-wide test settings shared by every tier."""

from __future__ import annotations

import os

# Safety belt: kwok gives simulated pods made-up IPs (private ranges). The operator must never
# send probe or status traffic to addresses outside this machine during tests, so restrict it to
# loopback; worker processes of the process node live on 127.0.x.y. Subprocesses inherit this.
os.environ.setdefault("WEIGHTLIFT_PROBE_NETWORKS", "127.0.0.0/8")
