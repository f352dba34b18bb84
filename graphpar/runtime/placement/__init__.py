"""Host placement: where optimizer updates, master weights and embedding tables live.

The passes place_on_host (tags) and lower_placement (inserts transfers) decide and
record placement on the graphs; this package holds the run-time pieces those graphs call:
transfers between the device and the host, the per-bucket update modules of a rank's
update program, the runner that starts host steps during backward, and host embeddings.
See docs/placement.md.
"""
