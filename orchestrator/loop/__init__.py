"""The step loop: a request's state (batching, output, text, validation), the scheduler that runs target steps and
rounds of drafts (speculation, proposing, placement on replicas, hybrid and n-gram drafts), what it counts
(accounting, acceptance, metrics), the releases it owes, and Generate's front to it (generation). A request's
committed tokens live in its ActiveRequest (batching.py); after a preemption or a target restart it is replayed from
them (scheduler.py, peers/recovery.py)."""
