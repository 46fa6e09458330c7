"""Speed: ``vtprune bench speed`` (random-weight speed-proxy models: ``generate()`` end to end, prefill,
decode, memory, batches), ``footprint`` (what the engine costs a long-lived server), host-sync counting
(:mod:`.syncs`), and ``speed-report``."""
