"""The events chaos writes when it strikes a fault (chaos/): none is shown while a job runs."""

from __future__ import annotations

from elastic.event_types.contract import declare

FAULT_INJECTED = declare(
    "fault_injected",
    "chaos",
    "kind target signal pids link rate_mbit free_mb factor how",
    "a fault was struck (written before its signal is sent)",
)
FAULT_CLEARED = declare(
    "fault_cleared", "chaos", "kind target signal pids link", "a fault ended, or a node restarted"
)
FAULT_SKIPPED = declare(
    "fault_skipped", "chaos", "kind target reason", "a fault due could not be carried out"
)
CHECKPOINT_VERIFIED = declare(
    "checkpoint_verified",
    "chaos",
    "kind target refused",
    "a corrupted checkpoint was verified at once",
)
